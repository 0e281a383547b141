"""The JSON log every pagedq command writes on stderr (structlog), configured once per process by its command.

A leaf module: it imports no other part of pagedq/worker/, so any layer may configure or use the log.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger


class _CurrentStderr:
    """Whatever sys.stderr is when a line is written. structlog's PrintLogger keeps the file it was given, and a
    worker started later in the same process (tests capturing stderr, an embedding app replacing it) must not
    write to a closed one: that raised in the worker loop and stopped it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def worker_logger(name: str) -> FilteringBoundLogger:
    """The worker's log, with its consumer name bound: the loop and what the assembly builds for it share it."""
    import structlog

    return structlog.get_logger("pagedq.worker").bind(worker=name)


def configure_logging(level: str = "info") -> None:
    import structlog

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(_CurrentStderr()),  # type: ignore[arg-type]  # a TextIO's write
        cache_logger_on_first_use=True,
    )
