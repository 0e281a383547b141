"""The worker's JSON log follows sys.stderr: a logger configured while one stream was current keeps working after
that stream is closed and replaced (what pytest's capture and embedding applications do)."""

from __future__ import annotations

import io
import json
import sys

import pytest
import structlog

from pagedq.worker.logs import configure_logging


def test_a_log_line_goes_to_the_current_stderr_after_the_first_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("info")
    log = structlog.get_logger("pagedq.test")
    log.info("one", n=1)
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    log.info("two", n=2)  # before: ValueError: I/O operation on closed file (it stopped a worker loop)
    record = json.loads(second.getvalue())
    assert record["event"] == "two" and record["n"] == 2 and record["level"] == "info"
    structlog.reset_defaults()
