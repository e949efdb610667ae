"""`python -m engine.sim`: run the engine simulator."""

import sys

from engine.sim.server import main

sys.exit(main())
