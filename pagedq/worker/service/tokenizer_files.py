"""A worker publishes its tokenizer's files at start, so the gateway serves /tokenize and /detokenize with the very
tokenizer the engine uses (the gateway loads the same files; it holds no model and never asks a busy worker)."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any

from pagedq.worker.protocol.keys import QueueKeys, model_id

MAX_TOKENIZER_BYTES = 64 * 1024 * 1024  # larger tokenizers are not published (the gateway answers 503)


def tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """What save_pretrained writes (tokenizer.json, its config with the chat template, special tokens)."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def publish_tokenizer(
    redis_client: Any, keys: QueueKeys, model: str, engine: Any, chars_per_token: int | None = None
) -> bool:
    """Write the engine's tokenizer files under the model's key, with their digest; False when it has none. The
    model's size bounds go there too, files or not: its max length and the most characters one token stands for
    (protocol/prompt_size.py), with which the gateway refuses a prompt too long by its characters before queuing it."""
    fields: dict[str, bytes | str | int] = {}
    max_model_len = getattr(engine, "max_model_len", None)
    if isinstance(max_model_len, int):
        fields["max_model_len"] = max_model_len
    if chars_per_token is not None:
        fields["chars_per_token"] = chars_per_token
    tokenizer = getattr(engine, "tokenizer", None)
    published = tokenizer is not None and hasattr(tokenizer, "save_pretrained")
    if published:
        files = tokenizer_files(tokenizer)
        published = sum(len(b) for b in files.values()) <= MAX_TOKENIZER_BYTES
        if published:
            digest = hashlib.sha256(b"".join(name.encode() + b"\0" + data for name, data in files.items())).hexdigest()
            fields.update(files, digest=digest)
    key = keys.tokenizer(model_id(model or "unknown"))
    pipe = redis_client.pipeline(transaction=True)
    pipe.delete(key)
    if fields:
        pipe.hset(key, mapping=fields)
    pipe.execute()
    return published
