"""Refusing a prompt too long by its characters before it is queued: no worker spends time rendering or tokenising
it, and the caller learns at once (400 in OpenAI's shape, code `prompt_too_long`).

The bound is the one the worker applies (protocol/prompt_size.py): the model's max length and the most characters
one token of its tokenizer stands for, published by its workers beside the tokenizer files (a model without a
provable bound is not checked here; its workers still count every prompt). A text prompt is measured exactly; token
ids by their count. A conversation is measured before its chat template writes it, so only by what every template
writes in full (prompt_size.conversation_chars: the contents of the system, developer, user and tool turns, and the
tools' definitions at half their compact JSON). The worker checks the rendered text exactly."""

from __future__ import annotations

import time
from typing import Any

from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.protocol.job import Job
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.protocol.prompt_size import conversation_chars, too_many_chars, too_many_tokens


class PromptLimits:
    def __init__(self, redis_client: Any, keys: QueueKeys, cache_s: float) -> None:
        self.r, self.keys, self.cache_s = redis_client, keys, cache_s
        self._cached: dict[str, tuple[float, int | None, int | None]] = {}

    async def bound(self, model: str) -> tuple[int | None, int | None]:
        """(max_model_len, chars_per_token) its workers published for a served model id; None where unknown."""
        now = time.monotonic()
        cached = self._cached.get(model)
        if cached is None or now - cached[0] >= self.cache_s:
            raw_len, raw_chars = await self.r.hmget(self.keys.tokenizer(model), "max_model_len", "chars_per_token")
            cached = self._cached[model] = (now, _int(raw_len), _int(raw_chars))
        return cached[1], cached[2]

    async def check(self, model: str, jobs: list[Job]) -> None:
        """400 naming the limit for the first job whose prompt cannot fit the model by its size alone."""
        max_model_len, chars_per_token = await self.bound(model)
        if max_model_len is None:
            return
        for job in jobs:
            reason, param = prompt_too_long(job, max_model_len, chars_per_token)
            if reason is not None:
                raise OpenAIError(400, reason, param=param, code="prompt_too_long")


def prompt_too_long(job: Job, max_model_len: int, chars_per_token: int | None) -> tuple[str | None, str]:
    """Why the job's prompt cannot fit in max_model_len with its max_tokens (None when it may), and its field."""
    budget = max_model_len - job.max_tokens
    if job.prompt_token_ids is not None:
        return too_many_tokens(len(job.prompt_token_ids), job.max_tokens, max_model_len), "prompt"
    if job.prompt is not None:
        return too_many_chars(len(job.prompt), budget, chars_per_token), "prompt"
    if job.messages is None:
        return None, "messages"
    return too_many_chars(conversation_chars(job), budget, chars_per_token), "messages"


def _int(raw: bytes | str | None) -> int | None:
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None
