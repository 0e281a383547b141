"""The job of the wire protocol (pydantic v2, strict, unknown fields forbidden); its result records: records.py."""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagedq.engine import limits as sampling
from pagedq.engine.limits import SAMPLING_LIMITS, D, Limit, Num
from pagedq.engine.lora.request import MAX_LORA_NAME_CHARS, check_lora_name
from pagedq.engine.sample.sampling_params import RequestOutputKind, SamplingParams
from pagedq.engine.structured_output.params import StructuredOutputsParams
from pagedq.worker.protocol import limits
from pagedq.worker.protocol.chat import MAX_TOOLS, ChatMessage, Tool
from pagedq.worker.protocol.errors import JobRejected
from pagedq.worker.protocol.limits import check_metadata
from pagedq.worker.protocol.records import Choice, Delta, FinalRecord, Status, Timings, Usage  # noqa: F401 (re-exported)
from pagedq.worker.protocol.trace_context import Traceparent, Tracestate

MAX_PROMPT_CHARS = 1_000_000  # a hard cap before tokenisation; the engine also enforces max_model_len
MAX_JOB_ID_CHARS = 200
MAX_ERRORS_SHOWN = 10  # validation errors quoted in a rejection reason
STATUSES: tuple[Status, ...] = get_args(Status)  # the per-status counters (heartbeat, metrics) in this order
# The job's sampling fields, the one list (the gateway's job fields and the Batch lines derive theirs from it): the
# numeric ones of the engine's table of bounds (pagedq/engine/limits.py) that a job carries, then the others.
SAMPLING_FIELDS: tuple[str, ...] = (
    *(name for name, limit in SAMPLING_LIMITS.items() if limit.in_job),
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "logit_bias",
    "structured_outputs",
)
# Sampling fields added after the first wire version: sent only when not at their default, so workers that
# predate them (which reject unknown fields) still accept every job that does not use them.
LATER_SAMPLING_DEFAULTS = {
    name: SAMPLING_LIMITS[name].default
    for name in ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "best_of")
} | {"include_stop_str_in_output": False, "logit_bias": None, "structured_outputs": None}
# and the later fields that are not sampling
LATER_JOB_DEFAULTS = {**LATER_SAMPLING_DEFAULTS, "echo": False} | dict.fromkeys(
    ("tools", "tool_call_parser", "traceparent", "tracestate", "lora")
)


def bounded(limit: Limit[Num, D]) -> D:
    """A pydantic field of a sampling parameter: its default and its range for jobs, from the table
    (pagedq/engine/limits.py)."""
    return Field(limit.default, **limit.for_jobs().bounds())


def optional(limit: Limit[Num, D]) -> Num | None:
    """The same, defaulting to None (unset: the job's default applies), as the OpenAI requests have them."""
    return Field(None, **limit.for_jobs().bounds())


_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]+$")
TokenId = Annotated[int, Field(ge=0, le=limits.MAX_TOKEN_ID)]
StopString = Annotated[str, Field(min_length=1, max_length=limits.MAX_STOP_CHARS)]
LogitBias = Annotated[float, Field(**sampling.LOGIT_BIAS.bounds())]


def token_id_keys(value: Any) -> Any:
    """logit_bias keys as JSON has them (decimal strings: OpenAI's, Celery's and the Batch lines' JSON) become
    token ids, for strict validation; anything else is left for it to refuse."""
    if isinstance(value, dict):
        return {int(k) if isinstance(k, str) and k.isdecimal() and len(k) < 20 else k: v for k, v in value.items()}
    return value


def structured_outputs_wire(value: Any) -> Any:
    """A job's structured_outputs checked as the engine will (exactly one kind, a parsable schema without keywords
    the grammar cannot enforce, a non-empty choice ...): a bad one is refused at submit, naming the problem."""
    if value is None:
        return None
    if isinstance(value, StructuredOutputsParams):
        return value.to_dict()
    return StructuredOutputsParams.from_dict(value).to_dict()


def new_job_id() -> str:
    return uuid.uuid4().hex


def to_vllm_priority(job_priority: int) -> int:
    """A job's `priority` in vLLM's sense, the one the engine, the bands' order and the gateway take: a lower value
    is served sooner. The job field keeps its wire sense (higher sooner), so the jobs existing producers send mean
    what they meant; this and its inverse are the one place the two senses meet."""
    return -job_priority


def from_vllm_priority(vllm_priority: int) -> int:
    """The job's `priority` field for a priority in vLLM's sense (to_vllm_priority's inverse)."""
    return -vllm_priority


class Job(BaseModel):
    """One generation job, as enqueued. JSON numbers may be ints where floats are expected, never the reverse."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    id: str = Field(
        default_factory=new_job_id, min_length=1, max_length=MAX_JOB_ID_CHARS, pattern=r"^[A-Za-z0-9_.:\-]+$"
    )
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    prompt_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, max_length=limits.MAX_MESSAGES)
    # OpenAI's function tools, rendered with the conversation (protocol/chat.py); "hermes": the caller parses the
    # answer's <tool_call> blocks (tool_choice auto), which a template writing calls in its own format refuses
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_call_parser: Literal["hermes"] | None = None
    # None: the rest of the model's context after the prompt (vLLM's None; OpenAI's chat default), worked out by the
    # worker once the prompt is counted (a worker that predates it rejects such a job)
    max_tokens: int | None = bounded(sampling.MAX_TOKENS)
    temperature: float = bounded(sampling.TEMPERATURE)
    top_p: float = bounded(sampling.TOP_P)
    top_k: int = bounded(sampling.TOP_K)
    min_p: float = bounded(sampling.MIN_P)
    seed: int | None = bounded(sampling.SEED)
    stop: list[StopString] | None = Field(default=None, max_length=limits.MAX_STOP_STRINGS)
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=limits.MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    logprobs: int | None = bounded(sampling.LOGPROBS)
    prompt_logprobs: int | None = bounded(sampling.PROMPT_LOGPROBS)  # score the prompt (e.g. documents' perplexity)
    stream: bool = False
    # Higher is served sooner (the wire's sense, unlike vLLM's): everything past the wire reads vllm_priority
    priority: int = Field(default=0, ge=-limits.MAX_PRIORITY, le=limits.MAX_PRIORITY)
    deadline: float | None = Field(default=None, ge=0.0, le=limits.MAX_DEADLINE, allow_inf_nan=False)  # unix time
    metadata: dict[str, Any] | None = None
    n: int = bounded(sampling.N)  # parallel samples of one prompt (the engine's, one job)
    presence_penalty: float = bounded(sampling.PRESENCE_PENALTY)
    frequency_penalty: float = bounded(sampling.FREQUENCY_PENALTY)
    repetition_penalty: float = bounded(sampling.REPETITION_PENALTY)
    min_tokens: int = bounded(sampling.MIN_TOKENS)
    best_of: int | None = bounded(sampling.BEST_OF)  # sample this many, keep the n most likely (at least n)
    include_stop_str_in_output: bool = False
    # token id (a JSON string key) -> bias added to its logit, in [-100, 100] (OpenAI's and vLLM's bounds)
    logit_bias: dict[TokenId, LogitBias] | None = Field(default=None, max_length=sampling.LOGIT_BIAS_MAX_ENTRIES)
    # the records (and the first delta) also carry the prompt: its text and token ids (OpenAI's echo)
    echo: bool = False
    # constrain the output: vLLM's StructuredOutputsParams fields (json | json_object | regex | choice | grammar,
    # and disable_any_whitespace); a grammar that does not compile or compiles too slowly is `rejected`
    structured_outputs: dict[str, Any] | None = None
    # Who the job is for: tenants share a band fairly (pagedq/worker/service/tenants.py); the gateway sets it from
    # the API key
    tenant: str | None = Field(default=None, max_length=limits.MAX_TENANT_CHARS, pattern=limits.TENANT_PATTERN)
    # The producer's W3C trace context (protocol/trace_context.py): the worker's spans of this job continue its trace
    traceparent: Traceparent | None = None
    tracestate: Tracestate | None = None
    # The LoRA adapter to run the job with (its name in the worker's --lora-modules or the queue's registry,
    # protocol/keys.py `loras`); None: the base model. An unknown or unloadable adapter: `rejected`, naming it
    lora: str | None = Field(default=None, max_length=MAX_LORA_NAME_CHARS)

    _metadata_is_json = field_validator("metadata")(check_metadata)

    _logit_bias_keys = field_validator("logit_bias", mode="before")(lambda value: token_id_keys(value))

    _structured_outputs = field_validator("structured_outputs", mode="before")(structured_outputs_wire)

    _lora_name = field_validator("lora")(lambda name: None if name is None else check_lora_name(name))

    @model_validator(mode="after")
    def _check(self) -> Job:
        given = [self.prompt, self.prompt_token_ids, self.messages]
        if sum(x is not None for x in given) != 1:
            raise ValueError("exactly one of prompt, prompt_token_ids or messages must be given")
        if self.messages is not None:
            if not self.messages:
                raise ValueError("messages must not be empty")
            if sum(len(m.content or "") for m in self.messages) > MAX_PROMPT_CHARS:
                raise ValueError(f"messages hold more than {MAX_PROMPT_CHARS} characters")
        elif self.tools is not None or self.tool_call_parser is not None:
            raise ValueError("tools and tool_call_parser go with messages")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("prompt must not be empty")
        if self.prompt_token_ids is not None:
            if not self.prompt_token_ids:
                raise ValueError("prompt_token_ids must not be empty")
            if min(self.prompt_token_ids) < 0:
                raise ValueError("prompt_token_ids must be non-negative token ids")
        if self.stop is not None and not all(self.stop):
            raise ValueError("stop must hold non-empty strings")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        if self.tracestate is not None and self.traceparent is None:
            raise ValueError("tracestate goes with a traceparent")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of > n cannot stream: the n best are known only at the end")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for engine.SamplingParams."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS}

    @property
    def vllm_priority(self) -> int:
        """The job's priority in vLLM's sense (lower is served sooner), as the bands and the engine take it."""
        return to_vllm_priority(self.priority)

    @property
    def picks_best(self) -> bool:
        """best_of > n: the engine samples more than it returns, and picks the n best only at the end."""
        return self.best_of is not None and self.best_of > self.n

    def to_sampling_params(
        self, output_kind: RequestOutputKind = RequestOutputKind.DELTA, room: int | None = None
    ) -> SamplingParams:
        """The engine's parameters for this job (the worker streams deltas; a job that picks the best of its
        samples gets only the final output). room: the tokens the model's context leaves after the prompt, which a
        job without max_tokens takes. Raises ValueError where the engine refuses them, which a validated job never
        meets (both check the same table), and for a job without max_tokens given no room."""
        if self.picks_best:
            output_kind = RequestOutputKind.FINAL_ONLY
        kwargs = self.sampling_kwargs()
        if self.max_tokens is None:
            if room is None:
                raise ValueError("a job without max_tokens takes the context's room after its prompt: give room")
            kwargs["max_tokens"] = room
        params = SamplingParams(**kwargs, output_kind=output_kind)
        if params.structured_outputs is not None:  # its compile shares the threads by tenant, not first come
            params.structured_outputs.compile_source = self.tenant or ""
        return params

    def chat(self) -> list[dict[str, Any]] | None:
        """The messages as dicts (what tokenizer.apply_chat_template takes), only the fields each one has."""
        return None if self.messages is None else [m.as_dict() for m in self.messages]

    def to_json(self) -> str:
        # A job without messages serialises without the key, so workers that predate chat still accept it.
        exclude = {name for name, default in LATER_JOB_DEFAULTS.items() if getattr(self, name) == default}
        if self.messages is None:
            exclude.add("messages")
        if self.tenant is None:  # likewise: workers that predate tenants accept jobs without one
            exclude.add("tenant")
        return self.model_dump_json(exclude=exclude or None)


def parse_job(raw: bytes | str) -> Job:
    """Validate one job stream entry's JSON; raise JobRejected naming every problem (the size and depth
    limits are checked on the raw bytes first, so no parser recurses through a hostile document)."""
    raw_bytes = raw.encode() if isinstance(raw, str) else raw
    problem = limits.entry_problem(raw_bytes)
    if problem is not None:
        raise JobRejected(problem)
    try:
        return Job.model_validate_json(raw_bytes)
    except ValidationError as exc:
        raise JobRejected(describe_errors(exc)) from None


def build_job(**fields: Any) -> Job:
    """Validate a job given as Python keywords (the client side); raise JobRejected before anything is sent."""
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    try:
        return Job.model_validate(fields)
    except ValidationError as exc:
        raise JobRejected(describe_errors(exc)) from None
    except RecursionError:  # a self-referencing or absurdly deep Python object among the fields
        raise JobRejected("invalid job: a field is nested too deeply (or refers to itself)") from None


def describe_errors(exc: ValidationError) -> str:
    parts, errors = [], exc.errors(include_url=False)
    for err in errors[:MAX_ERRORS_SHOWN]:  # a million bad token ids must not make a million-line reason
        where = ".".join(str(p) for p in err["loc"]) or "job"
        parts.append(f"{where}: {err['msg']}")
    if len(errors) > MAX_ERRORS_SHOWN:
        parts.append(f"and {len(errors) - MAX_ERRORS_SHOWN} more")
    return "invalid job: " + "; ".join(parts)


def valid_job_id(job_id: str) -> bool:
    """The job id grammar (native jobs, Celery task ids, bulk ids): [A-Za-z0-9_.:-]{1,200}."""
    # fullmatch, not match: "$" also matches before a final newline
    return len(job_id) <= MAX_JOB_ID_CHARS and _ID_RE.fullmatch(job_id) is not None
