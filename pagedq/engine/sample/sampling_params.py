"""Sampling parameters of one request (vLLM's names and defaults), validated on construction against the one
table of bounds (pagedq/engine/limits.py) that the queue's jobs and the OpenAI gateway also read."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TypeGuard

from pagedq.engine import limits
from pagedq.engine.errors import RequestRejected
from pagedq.engine.structured_output.params import StructuredOutputsParams


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` reports for a request each time it advances."""

    CUMULATIVE = "cumulative"  # all tokens/text so far
    DELTA = "delta"  # only what is new since the last report
    FINAL_ONLY = "final_only"  # nothing until the request finishes, then everything


@dataclass
class SamplingParams:
    n: int = limits.N.default
    best_of: int | None = limits.BEST_OF.default  # sample this many, return the n with the highest cumulative logprob
    max_tokens: int = limits.MAX_TOKENS.default
    min_tokens: int = limits.MIN_TOKENS.default
    temperature: float = limits.TEMPERATURE.default
    top_p: float = limits.TOP_P.default
    top_k: int = limits.TOP_K.default  # -1 (or 0) disables
    min_p: float = limits.MIN_P.default
    repetition_penalty: float = limits.REPETITION_PENALTY.default
    presence_penalty: float = limits.PRESENCE_PENALTY.default
    frequency_penalty: float = limits.FREQUENCY_PENALTY.default
    seed: int | None = limits.SEED.default
    # A single string or None is accepted too (the wire format allows both): __post_init__ makes it a list.
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # None is accepted too, as for stop
    ignore_eos: bool = False
    # Keep the stop string that ended the text (and the text of a stop token, EOS included) in the output
    include_stop_str_in_output: bool = False
    logprobs: int | None = limits.LOGPROBS.default
    # per prompt token: its log-probability and the top-k alternatives
    prompt_logprobs: int | None = limits.PROMPT_LOGPROBS.default
    skip_special_tokens: bool = True
    # token id -> a bias added to its logit before penalties and filters (OpenAI's logit_bias; vLLM's bounds)
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrain the output to a JSON schema, regex, choice or grammar (a dict of the same fields is accepted)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        try:
            self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        except (TypeError, ValueError):
            raise RequestRejected(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}") from None
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias) or None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.best_of is None and _is_int(self.n):
            self.best_of = self.n
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise RequestRejected(f"{name} {message}, got {getattr(self, name)!r}")

        for name, limit in limits.SAMPLING_LIMITS.items():
            value = getattr(self, name)
            if not ((value is None and limit.default is None) or limit.contains(value)):  # worded only on failure
                check(False, name, f"must be {limit.describe()}")
        check(self.best_of is None or self.best_of >= self.n, "best_of", "must be at least n")
        check(self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must hold non-empty strings")
        check(
            all(0 <= t <= limits.MAX_TOKEN_ID for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be token ids in [0, {limits.MAX_TOKEN_ID}]",
        )
        check(isinstance(self.output_kind, RequestOutputKind), "output_kind", "must be a RequestOutputKind")
        check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams or a dict of its fields",
        )
        if self.logit_bias is not None:
            self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias or {}
        if len(bias) > limits.LOGIT_BIAS_MAX_ENTRIES:
            raise RequestRejected(
                f"logit_bias must hold at most {limits.LOGIT_BIAS_MAX_ENTRIES} tokens, got {len(bias)}"
            )
        for token, value in bias.items():
            if not (_is_int(token) and 0 <= token <= limits.MAX_TOKEN_ID):
                raise RequestRejected(f"logit_bias keys must be token ids in [0, {limits.MAX_TOKEN_ID}], got {token!r}")
            if not limits.LOGIT_BIAS.contains(value):
                raise RequestRejected(f"logit_bias values must be {limits.LOGIT_BIAS.describe()}, got {value!r}")

    @property
    def num_samples(self) -> int:
        """How many sequences are sampled: best_of, which __post_init__ sets to n when it was not given."""
        return self.n if self.best_of is None else self.best_of

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
