"""Who owns a file or a batch: the caller's tenant, or for a key with no tenant a digest of the key.

OpenAI scopes files and batches to a project; here the project is the tenant (settings.api_key_tenants) or,
for a plain API key, the key itself (as a digest, so Redis never holds a key). A keyless gateway is one owner.
Every other owner gets 404 for an object, as if it did not exist. Objects stored before owners were kept have no
owner field: they belong to the keyless owner, so a keyless gateway serves them as before and a gateway with keys
serves them to nobody (there is no telling which key made them) until they expire."""

from __future__ import annotations

import hashlib

from fastapi import Request

from pagedq.worker.protocol.replies import text as reply_text

KEYLESS = ""  # the one owner of a gateway with no API keys


def owner_of(key: str | None, tenant: str | None) -> str:
    """The owner a request authenticated with `key` (mapped to `tenant`, or to none) acts as."""
    if tenant is not None:
        return f"tenant:{tenant}"
    if not key:
        return KEYLESS
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]


def request_owner(request: Request) -> str:
    """The owner authentication put on the request (app.py's _authenticate); keyless when none."""
    return getattr(request.state, "owner", KEYLESS)


def owns(stored: bytes | str | None, owner: str) -> bool:
    """Whether `owner` owns an object whose owner field is `stored` (None: an object from before owners)."""
    return (reply_text(stored) if stored is not None else KEYLESS) == owner
