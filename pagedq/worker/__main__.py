import sys

from pagedq.worker.cli.main import main

sys.exit(main())
