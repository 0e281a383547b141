"""The `pagedq` command (`pagedq.worker.cli:main`, also `python -m pagedq.worker`): the top of worker/, importing
any layer."""

from pagedq.worker.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
