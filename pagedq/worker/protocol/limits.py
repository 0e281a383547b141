"""Input limits of the wire protocol: every job stream entry is checked against these before it is parsed.

A job entry is hostile until proven otherwise: it may be huge, nested thousands of levels deep, hold
integers past 2**63 or bytes that are not UTF-8. The size and depth checks run on the raw bytes, so no
parser (pydantic's, json's, the final record's serializer) ever recurses through a hostile document.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from pagedq.engine.limits import MAX_TOKEN_ID  # noqa: F401 (prompt and stop token ids; the sampling bounds: pagedq/engine/limits.py)

MAX_ENTRY_BYTES = 8 * 1024 * 1024  # a job's JSON: a 1M-character prompt, \u-escaped, still fits
MAX_JSON_DEPTH = 32  # objects and arrays, the job object itself counting as level 1
MAX_METADATA_BYTES = 64 * 1024  # metadata as compact JSON (it is copied into every final record)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 10_000
MAX_PRIORITY = 1_000_000  # |priority|
MAX_DEADLINE = 1e11  # unix seconds (year 5138): larger is a unit mistake (ms, ns)
# Tenants (pagedq/worker/service/tenants.py): a job's optional `tenant`, the fair-share weights a worker is given
MAX_TENANT_CHARS = 64
TENANT_PATTERN = r"^[A-Za-z0-9_.:\-]{1,64}$"
MAX_TENANT_WEIGHT = 1000.0
MAX_TENANTS_WEIGHTED = 10_000
DEFAULT_TENANT_BURST = 8  # rounds of catch-up credit a tenant back from idle may claim (0: plain DRR)
MAX_TENANT_BURST = 1_000
MAX_TENANT_QUEUED = 1_000_000  # a tenant's unfinished jobs under a per-tenant limit (the SUBMIT script scans them)
# LoRA adapters (issue 36): a job's `lora` names one (the name's rule: pagedq/engine/lora/request.py); the registry
# (QueueKeys.loras) maps names to folders
MAX_REGISTERED_LORAS = 1024  # adapters one queue's registry holds (each worker reads it whole when it changes)

# A string literal; one never closed runs to the end (the document is invalid JSON then, its brackets no matter), so
# the scan never backtracks: without that, each quote of an unterminated string restarts it, quadratic in the entry.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)
_DEPTH_DELTA = np.zeros(256, dtype=np.int8)
_DEPTH_DELTA[[ord("["), ord("{")]] = 1
_DEPTH_DELTA[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
    """Nesting depth of a JSON document (brackets inside strings do not count), without parsing it; a
    document with at most MAX_JSON_DEPTH brackets gets their count (a bound on its depth) without a scan.

    Vectorised: a hostile 8 MiB entry of brackets costs a few milliseconds, not a recursion."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:  # the usual job: nothing to scan
        return raw.count(b"[") + raw.count(b"{")
    structure = _STRING.sub(b'""', raw)
    deltas = _DEPTH_DELTA[np.frombuffer(structure, dtype=np.uint8)]
    return int(np.cumsum(deltas, dtype=np.int64).max(initial=0))


def entry_problem(raw: bytes) -> str | None:
    """Why a raw job entry is refused before parsing (too big, too deep), or None."""
    if len(raw) > MAX_ENTRY_BYTES:
        return f"job entry is {len(raw)} bytes, more than the limit of {MAX_ENTRY_BYTES}"
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        return f"job JSON is nested {depth} levels deep, more than the limit of {MAX_JSON_DEPTH}"
    return None


def check_json_value(value: Any, depth: int = 2) -> None:
    """Raise ValueError unless value is plain JSON (str-keyed dicts, lists, str, int, finite float, bool,
    None) nested at most MAX_JSON_DEPTH levels counting from `depth` (metadata sits at level 2 of a job)."""
    stack = [(value, depth)]
    while stack:  # iterative: a Python object nested 10,000 deep must not exhaust the stack either
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            if level > MAX_JSON_DEPTH:
                raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep (counting the job itself)")
            if isinstance(item, dict):
                if not all(isinstance(k, str) for k in item):
                    raise ValueError("object keys must be strings")
                stack.extend((v, level + 1) for v in item.values())
            else:
                stack.extend((v, level + 1) for v in item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError(f"{item!r} is not a JSON number")
        elif item is not None and not isinstance(item, (str, int, bool)):
            raise ValueError(f"{type(item).__name__} is not a JSON value")


def check_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """metadata: plain JSON, within the depth and size limits (it is echoed in every final record)."""
    if value is None:
        return None
    check_json_value(value)
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"is {size} bytes as JSON, more than the limit of {MAX_METADATA_BYTES}")
    return value
