"""`python -m pagedq.engine generate ...`: the engine's commands without the queue stack installed."""

import sys

from pagedq.engine.cli import main

sys.exit(main())
