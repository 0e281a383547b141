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


def publish_tokenizer(redis_client: Any, keys: QueueKeys, model: str, engine: Any) -> bool:
    """Write the engine's tokenizer files under the model's key, with their digest; False when it has none."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        return False
    files = tokenizer_files(tokenizer)
    if sum(len(b) for b in files.values()) > MAX_TOKENIZER_BYTES:
        return False
    digest = hashlib.sha256(b"".join(name.encode() + b"\0" + data for name, data in files.items())).hexdigest()
    fields: dict[str, bytes | str | int] = {**files, "digest": digest}
    max_model_len = getattr(engine, "max_model_len", None)
    if isinstance(max_model_len, int):
        fields["max_model_len"] = max_model_len
    key = keys.tokenizer(model_id(model or "unknown"))
    pipe = redis_client.pipeline(transaction=True)
    pipe.delete(key)
    pipe.hset(key, mapping=fields)
    pipe.execute()
    return True
