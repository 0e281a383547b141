"""Pieces both endpoints' responses share: usage, choices of a final record, log-probabilities.

The gateway holds no tokenizer (it is a thin, stateless process): the worker's records name the text of every
token they carry (`token_texts`), which the log-probabilities show as vLLM does. `return_tokens_as_token_ids`
(or a record without token texts: a worker without a tokenizer) names them "token_id:<id>" instead.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedq.worker.protocol.job import Choice, FinalRecord

LOGPROB_FLOOR = -9999.0  # what OpenAI and vLLM send for -inf (JSON has no infinity)
Entry = dict[str, float] | None  # one position's logprobs: token id (a string key) -> logprob; None: none
DONE = b"data: [DONE]\n\n"  # the end of a completions or chat stream


def event(payload: dict[str, Any]) -> bytes:
    """One Server-Sent Event of completions and chat: a bare data line."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def token_name(token_id: int | str) -> str:
    return f"token_id:{token_id}"


@dataclass(frozen=True)
class TokenNames:
    """How tokens are named: their text from a record's `token_texts`, or "token_id:<id>"."""

    texts: dict[str, str] | None
    as_ids: bool = False

    def __call__(self, token_id: int | str) -> str:
        key = str(token_id)
        if self.as_ids or self.texts is None or key not in self.texts:
            return token_name(key)
        return self.texts[key]


def usage(records: Sequence[FinalRecord]) -> dict[str, int]:
    p = sum(r.usage.prompt_tokens for r in records)
    c = sum(r.usage.completion_tokens for r in records)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def choices_of(record: FinalRecord) -> list[Choice]:
    """Every sample of the record, index order (records of n = 1 jobs carry no `choices`)."""
    if record.choices:
        return list(record.choices)
    return [
        Choice(
            index=0,
            text=record.text,
            token_ids=record.token_ids,
            finish_reason=record.finish_reason,
            stop_reason=record.stop_reason,
            logprobs=record.logprobs,
        )
    ]


def top_k(entry: dict[str, float], k: int) -> list[tuple[str, float]]:
    """The k most likely alternatives of one position (the engine adds the sampled token to its top k)."""
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


def _floor(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, LOGPROB_FLOOR)


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[Entry] | None, names: TokenNames, offset: int = 0
) -> dict | None:
    """Legacy completions' shape, as vLLM fills it: tokens, token_logprobs, top_logprobs (the sampled token
    first, then the top k; None where a position has none: the first prompt token), text_offset (each token's
    offset into the text, from `offset`: the text already sent for this choice)."""
    if entries is None:
        return None
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float | None] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries):
        name = names(token_id)
        offsets.append(offset)
        offset += len(name)
        tokens.append(name)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        own = entry.get(str(token_id))
        token_logprobs.append(_floor(own))
        top = {name: _floor(own)} if own is not None else {}
        for other, logprob in sorted(entry.items(), key=lambda kv: kv[1], reverse=True):
            top.setdefault(names(other), _floor(logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[Entry] | None, k: int, names: TokenNames) -> dict | None:
    """Chat's shape: per token its text, logprob, UTF-8 bytes and its k most likely alternatives."""
    if entries is None:
        return None
    content = []
    for t, e in zip(token_ids, entries):
        name, entry = names(t), e or {}
        content.append(
            {
                "token": name,
                "logprob": _floor(entry.get(str(t))),
                "bytes": _utf8(name),
                "top_logprobs": [
                    {"token": names(i), "logprob": _floor(lp), "bytes": _utf8(names(i))} for i, lp in top_k(entry, k)
                ],
            }
        )
    return {"content": content, "refusal": None}


def now() -> int:
    return int(time.time())


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
