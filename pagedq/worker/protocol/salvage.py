"""What a malformed job entry still tells: its id and metadata, so that its rejection reaches whoever waits on it
(admission.py rejects it under the id when there is one, else under the entry id)."""

from __future__ import annotations

import json
from typing import Any

from pagedq.worker.protocol import limits
from pagedq.worker.protocol.job import valid_job_id
from pagedq.worker.protocol.limits import check_metadata

SALVAGE_MAX_DEPTH = 500  # json.loads recurses; this deep is still far from Python's limit


def salvage(raw: bytes | str | None) -> tuple[str | None, dict[str, Any] | None]:
    """Best-effort (id, metadata) of a malformed job, so its rejection can still be addressed to it.

    Never raises: a document too big or too deep to parse safely, or whose metadata is not within the
    limits, yields (None, None) or (id, None)."""
    try:
        raw_bytes = raw.encode() if isinstance(raw, str) else raw
        if (
            not isinstance(raw_bytes, bytes)
            or len(raw_bytes) > limits.MAX_ENTRY_BYTES
            or limits.json_depth(raw_bytes) > SALVAGE_MAX_DEPTH
        ):
            return None, None
        data = json.loads(raw_bytes)
        if not isinstance(data, dict):
            return None, None
        job_id = data.get("id")
        if not (isinstance(job_id, str) and valid_job_id(job_id)):
            job_id = None
        meta = data.get("metadata")
        try:
            meta = check_metadata(meta) if isinstance(meta, dict) else None
        except ValueError:
            meta = None
        return job_id, meta
    except Exception:  # the entry's fault, whatever it is: reject it under its entry id
        return None, None
