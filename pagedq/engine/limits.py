"""The bounds of every numeric sampling parameter, once: the engine's SamplingParams, the queue's job model
(pagedq/worker/protocol/job.py) and the OpenAI request schema (pagedq/worker/gateway/schemas.py) all read this table.

Plain Python (no torch, no pydantic), so producers that only validate jobs import it cheaply. Every count and id
fits the int32/int64 tensors the sampler builds each step and every float is finite: a value out of range is
refused where it enters, never found as an OverflowError inside a step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Generic, TypedDict, TypeVar

MAX_INT = 2**31 - 1  # counts the engine holds in int32 tensors
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32 or int64 tensors; vocabularies are far smaller

Num = TypeVar("Num", int, float)  # the kind of number
D = TypeVar("D")  # the default: a number of that kind, or None where None means "unset"


class Bounds(TypedDict, total=False):
    """pydantic's Field keywords for a limit (`Field(**limit.bounds())`)."""

    ge: float
    gt: float
    le: float
    lt: float
    allow_inf_nan: bool


@dataclass(frozen=True)
class Limit(Generic[Num, D]):
    """One numeric sampling field: its kind, its default, its range, and its names on the OpenAI surface."""

    name: str
    kind: type[Num]
    default: D
    low: Num
    high: Num
    low_open: bool = False  # the range excludes `low` (it includes it otherwise); likewise high_open
    high_open: bool = False
    # The fields of the OpenAI requests (pagedq/worker/gateway/schemas.py) that carry it; () when they do not
    openai: tuple[str, ...] = ()
    in_job: bool = True  # a field of the queue's job (pagedq/worker/protocol/job.py)
    note: str = ""  # said after the range in the engine's error message
    # The queue's own upper bound, below the engine's, for the job and the OpenAI requests; None: the engine's
    job_high: Num | None = None

    def for_jobs(self) -> Limit[Num, D]:
        """The range a job (and an OpenAI request, which becomes one) may take: the engine's, or below it."""
        if self.job_high is None:
            return self
        return dataclasses.replace(self, high=self.job_high, job_high=None)

    # OpenAI's own upper bound where it is narrower than the engine's: the OpenAI requests take only up to it (the
    # offline API and the queue's jobs keep the engine's range)
    openai_high: Num | None = None

    def on_openai(self) -> Limit[Num, D]:
        """This limit as the OpenAI requests bound it (openai_high, when set)."""
        return self if self.openai_high is None else dataclasses.replace(self, high=self.openai_high)

    def contains(self, value: object) -> bool:
        """Whether value is of this kind (an int where a float is expected, never a bool) and in range."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        """The range as the engine's error messages word it: "an integer in [1, 16]", "a number in (0, 1]"."""
        kind = "an integer" if self.kind is int else "a number"
        low, high = ("(" if self.low_open else "[", ")" if self.high_open else "]")
        text = f"{kind} in {low}{self.low}, {self.high}{high}"
        if self.default is None:
            text = f"None or {text}"
        return f"{text} ({self.note})" if self.note else text

    def bounds(self) -> Bounds:
        """pydantic's Field keywords for the range (floats: finite only)."""
        bounds = Bounds(gt=self.low) if self.low_open else Bounds(ge=self.low)
        if self.high_open:
            bounds["lt"] = self.high
        else:
            bounds["le"] = self.high
        if self.kind is float:
            bounds["allow_inf_nan"] = False
        return bounds


# Parallel samples of one request: they share the prompt's KV blocks; those past max_num_seqs wait for seats. The
# offline API takes as many as vLLM (its VLLM_MAX_N_SEQUENCES default: pass@k sends hundreds); a job, whose samples
# all come back in one record, stays at the queue's bound
MAX_SAMPLES = 16_384
MAX_JOB_SAMPLES = 16
N: Limit[int, int] = Limit("n", int, 1, 1, MAX_SAMPLES, openai=("n",), job_high=MAX_JOB_SAMPLES)
# At least n (SamplingParams checks that); the n with the highest cumulative logprob are returned
BEST_OF: Limit[int, int | None] = Limit(
    "best_of", int, None, 1, MAX_SAMPLES, openai=("best_of",), note="and at least n", job_high=MAX_JOB_SAMPLES
)
# The engine also enforces prompt + max_tokens <= max_model_len
MAX_TOKENS: Limit[int, int] = Limit("max_tokens", int, 16, 1, 1_000_000, openai=("max_tokens", "max_completion_tokens"))
MIN_TOKENS: Limit[int, int] = Limit(
    "min_tokens", int, 0, 0, 1_000_000, openai=("min_tokens",), note="and <= max_tokens"
)
TEMPERATURE: Limit[float, float] = Limit(
    "temperature", float, 1.0, 0.0, 100.0, openai=("temperature",), openai_high=2.0
)
TOP_P: Limit[float, float] = Limit("top_p", float, 1.0, 0.0, 1.0, low_open=True, openai=("top_p",))
# Past any vocabulary (the same as disabled)
TOP_K: Limit[int, int] = Limit("top_k", int, -1, -1, 1_000_000, openai=("top_k",), note="-1 or 0 disables")
MIN_P: Limit[float, float] = Limit("min_p", float, 0.0, 0.0, 1.0, openai=("min_p",))
REPETITION_PENALTY: Limit[float, float] = Limit(
    "repetition_penalty", float, 1.0, 0.0, 10.0, low_open=True, openai=("repetition_penalty",)
)
PRESENCE_PENALTY: Limit[float, float] = Limit("presence_penalty", float, 0.0, -2.0, 2.0, openai=("presence_penalty",))
FREQUENCY_PENALTY: Limit[float, float] = Limit(
    "frequency_penalty", float, 0.0, -2.0, 2.0, openai=("frequency_penalty",)
)
# Any 64-bit seed, signed or not: the engine folds it into its hash
SEED: Limit[int, int | None] = Limit("seed", int, None, -(2**63), 2**64 - 1, openai=("seed",))
# Top alternatives per token (vLLM's default max_logprobs); chat asks with logprobs: true and top_logprobs: k
LOGPROBS: Limit[int, int | None] = Limit("logprobs", int, None, 0, 20, openai=("logprobs", "top_logprobs"))
PROMPT_LOGPROBS: Limit[int, int | None] = Limit("prompt_logprobs", int, None, 0, 20)

# logit_bias (token id -> a bias added to its logit before penalties and filters): vLLM's and OpenAI's bounds
LOGIT_BIAS: Limit[float, float] = Limit("logit_bias", float, 0.0, -100.0, 100.0)  # each bias (not in the table)
LOGIT_BIAS_MAX_ENTRIES = 300  # at most this many tokens biased per request
# structured_outputs: the longest schema / regex / grammar / choice list (as JSON text) a request may carry
STRUCTURED_SPEC_MAX_CHARS = 64 * 1024
# JSON levels of a schema's objects and arrays, the schema itself level 1, whether it comes as a dict or as text: as
# deep as a dict schema fits in a job (whose JSON nests at most 32 levels, the job and its structured_outputs taking
# 2), which a schema sent as text escapes; compile cost grows steeply with depth (docs/structured-outputs.md)
STRUCTURED_SCHEMA_MAX_DEPTH = 30

AnyLimit = Limit[int, int] | Limit[int, int | None] | Limit[float, float]
SAMPLING_LIMITS: dict[str, AnyLimit] = {
    limit.name: limit
    for limit in (
        N,
        BEST_OF,
        MAX_TOKENS,
        MIN_TOKENS,
        TEMPERATURE,
        TOP_P,
        TOP_K,
        MIN_P,
        REPETITION_PENALTY,
        PRESENCE_PENALTY,
        FREQUENCY_PENALTY,
        SEED,
        LOGPROBS,
        PROMPT_LOGPROBS,
    )
}
