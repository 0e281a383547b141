"""The ids of files and batches: random (unguessable, so an id is only known to whom it was given), and checked
against their shape before any Redis key is built from them: an id with a colon could otherwise name another key of
the queue. A malformed id gets the 404 of a missing one, as OpenAI answers an unknown id."""

from __future__ import annotations

import re
import uuid

# Output and error files of batches created before output ids were random were named after their batch.
_FILE_ID = re.compile(r"file-(?:[0-9a-f]{32}|batch_[0-9a-f]{32}-(?:output|errors))")
_BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def is_file_id(value: str) -> bool:
    return _FILE_ID.fullmatch(value) is not None


def is_batch_id(value: str) -> bool:
    return _BATCH_ID.fullmatch(value) is not None
