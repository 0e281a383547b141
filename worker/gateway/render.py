"""Pieces both endpoints' responses share: usage, choices of a final record, log-probabilities.

The gateway holds no tokenizer (it is a thin, stateless process), so tokens in log-probabilities are
named as vLLM's `return_tokens_as_token_ids` names them: "token_id:<id>".
"""

from __future__ import annotations

import time

from worker.protocol.job import Choice, FinalRecord


def token_name(token_id: int | str) -> str:
    return f"token_id:{token_id}"


def usage(record: FinalRecord) -> dict[str, int]:
    p, c = record.usage.prompt_tokens, record.usage.completion_tokens
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


def completion_logprobs(token_ids: list[int], entries: list[dict[str, float]] | None, k: int) -> dict | None:
    """Legacy completions' shape: tokens, token_logprobs, top_logprobs (text_offset needs a tokenizer)."""
    if entries is None:
        return None
    pairs = list(zip(token_ids, entries))
    return {
        "tokens": [token_name(t) for t, _ in pairs],
        "token_logprobs": [e.get(str(t)) for t, e in pairs],
        "top_logprobs": [{token_name(i): lp for i, lp in top_k(e, k)} for _, e in pairs],
        "text_offset": None,
    }


def chat_logprobs(token_ids: list[int], entries: list[dict[str, float]] | None, k: int) -> dict | None:
    if entries is None:
        return None
    content = []
    for t, e in zip(token_ids, entries):
        content.append(
            {
                "token": token_name(t),
                "logprob": e.get(str(t)),
                "bytes": None,
                "top_logprobs": [{"token": token_name(i), "logprob": lp, "bytes": None} for i, lp in top_k(e, k)],
            }
        )
    return {"content": content, "refusal": None}


def now() -> int:
    return int(time.time())
