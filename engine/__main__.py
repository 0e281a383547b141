"""`python -m engine generate|bench ...`: the engine's commands without the queue stack installed."""

import sys

from engine.cli import main

sys.exit(main())
