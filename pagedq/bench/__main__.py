"""`python -m pagedq.bench throughput|host|ngram|structured|kernels ...`: without the queue stack installed."""

import sys

from pagedq.bench.cli import main

sys.exit(main())
