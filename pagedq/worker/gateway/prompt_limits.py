"""Refusing a prompt too long by its characters before it is queued: no worker spends time rendering or tokenising
it, and the caller learns at once (400 in OpenAI's and vLLM's shape, code `context_length_exceeded`, the words "maximum
context length" client libraries look for).

The bound is the one the worker applies (protocol/prompt_size.py): the model's max length and the most characters
one token of its tokenizer stands for, published by its workers beside the tokenizer files (a model without a
provable bound is not checked here; its workers still count every prompt). A text prompt is measured exactly; token
ids by their count. A conversation is measured before its chat template writes it, so only by what every template
writes in full (prompt_size.conversation_chars: the contents of the system, developer, user and tool turns, and the
tools' definitions at half their compact JSON). The worker checks the rendered text exactly."""

from __future__ import annotations

import time
from typing import Any

from pagedq.engine.errors import ContextLengthExceeded
from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.protocol.job import Job
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.protocol.prompt_size import chars_over, conversation_chars, prompt_source, tokens_over


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

    async def check(self, model: str, jobs: list[Job], param: str | None = None) -> None:
        """400 context_length_exceeded (OpenAI's and vLLM's shape) for the first job whose prompt cannot fit the
        model by its size alone; param: the request field that holds the prompt (else the job's own)."""
        max_model_len, chars_per_token = await self.bound(model)
        if max_model_len is None:
            return
        for job in jobs:
            refusal = prompt_too_long(job, max_model_len, chars_per_token)
            if refusal is not None:
                raise OpenAIError(400, str(refusal), param=param or prompt_source(job), code=refusal.code)


def prompt_too_long(job: Job, max_model_len: int, chars_per_token: int | None) -> ContextLengthExceeded | None:
    """Why the job's prompt cannot fit in max_model_len with its max_tokens, or None when it may."""
    if job.prompt_token_ids is not None:
        return tokens_over(len(job.prompt_token_ids), job, max_model_len)
    if job.prompt is not None:
        return chars_over(len(job.prompt), job, max_model_len, chars_per_token)
    if job.messages is None:
        return None
    return chars_over(conversation_chars(job), job, max_model_len, chars_per_token)


def _int(raw: bytes | str | None) -> int | None:
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None
