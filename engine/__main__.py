"""``python -m engine``: the same as the ``qwen38-engine`` command."""

import sys

from engine.cli import main

sys.exit(main())
