"""The one place xgrammar is imported: lazily, when the first request carrying structured_outputs arrives, so the
engine runs on a box without it (structured requests are then refused with this error)."""

from __future__ import annotations

from types import ModuleType

from pagedq.engine.errors import RequestRejected

INSTALL_HINT = "structured_outputs needs xgrammar: pip install 'xgrammar==0.2.8' (or pip install 'pagedq[structured]')"


def xgrammar() -> ModuleType:
    try:
        import xgrammar  # the project's one import of it (tests/test_layers.py checks)
    except ImportError as error:
        raise RequestRejected(f"{INSTALL_HINT} ({error})") from None
    return xgrammar
