"""Reading Redis replies. The clients are built without decode_responses, since job entries are checked as raw bytes
before parsing (pagedq/worker/protocol/limits.py); names, ids and counts in replies are read as text through here."""

from __future__ import annotations


def text(value: bytes | str | int | float) -> str:
    """A reply value as text: bytes decoded as UTF-8, anything else by str()."""
    return value.decode() if isinstance(value, bytes) else str(value)
