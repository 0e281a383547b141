"""The one place xgrammar is imported: lazily, when the first request carrying structured_outputs arrives, so the
engine runs on a box without it (structured requests are then refused with this error)."""

from __future__ import annotations

import json
import re
import sys
from types import ModuleType
from typing import Any

from pagedq.engine.errors import RequestRejected

INSTALL_HINT = "structured_outputs needs xgrammar: pip install 'xgrammar==0.2.8' (or pip install 'pagedq[structured]')"


def xgrammar() -> ModuleType:
    try:
        import xgrammar  # the project's one import of it (tests/test_layers.py checks)
    except ImportError as error:
        raise RequestRejected(f"{INSTALL_HINT} ({error})") from None
    return xgrammar


def json_schema_conversion_error(schema: dict[str, Any]) -> str | None:
    """What xgrammar's own converter says is wrong with a schema (None: it converts), so a schema that passes the
    worker's check compiles. It needs no tokenizer and takes milliseconds. Only where xgrammar is loaded already (the
    worker, once it compiles): a producer (the gateway, a client) does not load it for this, since it brings torch
    (seconds and hundreds of MB); there the worker's check answers, and the job is rejected naming the problem."""
    xgr = sys.modules.get("xgrammar")
    if xgr is None:
        return None
    try:
        xgr.Grammar.from_json_schema(json.dumps(schema))
    except (RuntimeError, ValueError, TypeError) as error:
        return backend_message(error)
    return None


def backend_message(error: BaseException) -> str:
    """xgrammar's error without its log prefix ("[12:00:00] /project/cpp/json_schema_converter.cc:4944: "), first
    line only, bounded."""
    text = _LOG_PREFIX.sub("", str(error).strip())
    return text.splitlines()[0][:500] if text else type(error).__name__


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
