"""Sampling parameters of one request (vLLM's names and defaults), validated on construction."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TypeGuard

# Upper bounds: every count and id must fit the int32/int64 tensors the sampler builds each step, and every
# float must be finite; out of range is refused here, never found as an OverflowError inside a step.
MAX_INT = 2**31 - 1  # n, best_of, max_tokens, min_tokens, top_k, logprobs, token ids
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 100.0  # repetition_penalty
SEED_RANGE = (-(2**63), 2**64 - 1)


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` reports for a request each time it advances."""

    CUMULATIVE = "cumulative"  # all tokens/text so far
    DELTA = "delta"  # only what is new since the last report
    FINAL_ONLY = "final_only"  # nothing until the request finishes, then everything


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # A single string or None is accepted too (the wire format allows both): __post_init__ makes it a list.
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # None is accepted too, as for stop
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token: its log-probability and the top-k alternatives
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == 0:
            self.top_k = -1
        if self.best_of is None and _is_int(self.n):
            self.best_of = self.n
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{name} {message}, got {getattr(self, name)!r}")

        check(_is_int(self.n) and 1 <= self.n <= MAX_INT, "n", f"must be an integer in [1, {MAX_INT}]")
        check(
            _is_int(self.best_of) and self.n <= self.best_of <= MAX_INT,
            "best_of",
            f"must be an integer in [n, {MAX_INT}]",
        )
        check(
            _is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT,
            "max_tokens",
            f"must be an integer in [1, {MAX_INT}]",
        )
        check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be an integer in [0, max_tokens]",
        )
        check(
            _is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"must be in [0, {MAX_TEMPERATURE}]",
        )
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(
            _is_int(self.top_k) and -1 <= self.top_k <= MAX_INT,
            "top_k",
            f"must be -1 (disabled) or a positive integer <= {MAX_INT}",
        )
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(
            _is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_PENALTY,
            "repetition_penalty",
            f"must be in (0, {MAX_PENALTY}]",
        )
        check(
            _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "must be in [-2, 2]",
        )
        check(
            _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "must be in [-2, 2]",
        )
        check(
            self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
            "seed",
            "must be None or a 64-bit integer",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must hold non-empty strings")
        check(
            all(0 <= t <= MAX_INT for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be token ids in [0, {MAX_INT}]",
        )
        check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_INT),
            "logprobs",
            f"must be None or an integer in [0, {MAX_INT}]",
        )
        check(
            self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_INT),
            "prompt_logprobs",
            f"must be None or an integer in [0, {MAX_INT}]",
        )
        check(isinstance(self.output_kind, RequestOutputKind), "output_kind", "must be a RequestOutputKind")

    @property
    def num_samples(self) -> int:
        """How many sequences are sampled: best_of, which __post_init__ sets to n when it was not given."""
        return self.n if self.best_of is None else self.best_of

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
