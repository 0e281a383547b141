"""What the engine hands back to its callers (vLLM's RequestOutput / CompletionOutput shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence. token_ids/text/logprobs are cumulative or a delta per the request's output_kind."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)  # arrival/first-token/finish times (time.monotonic)
    # With SamplingParams.prompt_logprobs: entry j for prompt token j (None for the first); in the first
    # output of a DELTA stream only.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (vLLM's field), counted at admission
    num_preemptions: int = 0  # times the scheduler took its KV blocks or its seat so far (the worker's spans)
    # Why the request ended early (finish_reason "abort"): e.g. its structured_outputs grammar failed to compile
    error: str | None = None
