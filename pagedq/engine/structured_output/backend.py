"""The one place xgrammar is imported: lazily, when the first request carrying structured_outputs arrives, so the
engine runs on a box without it (structured requests are then refused with this error)."""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType

from pagedq.engine.errors import RequestRejected

INSTALL_HINT = "structured_outputs needs xgrammar: pip install 'xgrammar==0.2.8' (or pip install 'pagedq[structured]')"


def xgrammar() -> ModuleType:
    try:
        import xgrammar  # the project's one import of it (tests/test_layers.py checks)
    except ImportError as error:
        raise RequestRejected(f"{INSTALL_HINT} ({error})") from None
    return xgrammar


def installed() -> bool:
    """Whether xgrammar is there to import, found without importing it (its import takes seconds): what a worker
    checks at start, to warn then rather than refuse each structured request later."""
    try:
        return importlib.util.find_spec("xgrammar") is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a broken half-installed module
        return False


def backend_message(error: BaseException) -> str:
    """xgrammar's error without its log prefix ("[12:00:00] /project/cpp/json_schema_converter.cc:4944: "), first
    line only, bounded."""
    text = _LOG_PREFIX.sub("", str(error).strip())
    return text.splitlines()[0][:500] if text else type(error).__name__


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
