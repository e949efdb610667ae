"""``python -m gateway``: the same as the ``qwen38-gateway`` command."""

import sys

from gateway.cli import main

sys.exit(main())
