"""The `pagedq` command (`worker.cli:main`, also `python -m worker`): the top of worker/, importing any layer."""

from worker.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
