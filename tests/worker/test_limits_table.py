"""One table of sampling bounds (pagedq/engine/limits.py), read by the three validators a job's sampling parameters
meet: the engine's SamplingParams, the queue's Job model and the gateway's OpenAI request schema. The probe values come
from the table; what is checked is each real validator, so a validator that drifts from the table fails here."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from pagedq.engine.limits import SAMPLING_LIMITS, AnyLimit
from pagedq.engine.sample.sampling_params import RequestOutputKind, SamplingParams
from pagedq.worker import Client
from pagedq.worker.gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingBody
from pagedq.worker.protocol.errors import JobRejected
from pagedq.worker.protocol.job import LATER_SAMPLING_DEFAULTS, SAMPLING_FIELDS, Job, build_job, parse_job
from pagedq.worker.testing.faults import FaultyEngine
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import run_burst

GATEWAY_BODIES: dict[type[BaseModel], dict[str, Any]] = {
    CompletionRequest: {"model": "m", "prompt": "x"},
    ChatCompletionRequest: {"model": "m", "messages": [{"role": "user", "content": "x"}]},
}


def step(limit: AnyLimit, value: int | float, direction: float) -> int | float:
    """The next value of the limit's kind from `value` towards `direction` (+inf or -inf)."""
    return value + int(math.copysign(1, direction)) if limit.kind is int else math.nextafter(float(value), direction)


def probes(limit: AnyLimit) -> list[tuple[int | float, bool]]:
    """(value, accepted) at each end of the range: the bound (or, for an open end, the first value inside) is
    accepted, the first value past it refused."""
    out: list[tuple[int | float, bool]] = []
    if limit.low_open:
        out += [(limit.low, False), (step(limit, limit.low, math.inf), True)]
    else:
        out += [(limit.low, True), (step(limit, limit.low, -math.inf), False)]
    if limit.high_open:
        out += [(limit.high, False), (step(limit, limit.high, -math.inf), True)]
    else:
        out += [(limit.high, True), (step(limit, limit.high, math.inf), False)]
    return out


def context(name: str) -> dict[str, Any]:
    """Other fields a probe needs to be valid apart from the probed one (min_tokens <= max_tokens)."""
    return {"max_tokens": SAMPLING_LIMITS["max_tokens"].high} if name == "min_tokens" else {}


CASES = [
    pytest.param(name, value, accepted, id=f"{name}={value!r}-{'ok' if accepted else 'refused'}")
    for name, limit in SAMPLING_LIMITS.items()
    for value, accepted in probes(limit)
]
# A job and an OpenAI request take the queue's range, which may stop below the engine's (n, best_of)
JOB_CASES = [
    pytest.param(name, value, accepted, id=f"{name}={value!r}-{'ok' if accepted else 'refused'}")
    for name, limit in SAMPLING_LIMITS.items()
    if limit.in_job
    for value, accepted in probes(limit.for_jobs())
]


@pytest.mark.parametrize("name, value, accepted", CASES)
def test_sampling_params_follow_the_table(name, value, accepted):
    kwargs = {**context(name), name: value}
    if accepted:
        assert getattr(SamplingParams(**kwargs), name) == value
    else:
        with pytest.raises(ValueError, match=rf"^{name} must be "):  # refused for this field, not another
            SamplingParams(**kwargs)


@pytest.mark.parametrize("name, value, accepted", JOB_CASES)
def test_the_job_follows_the_table(name, value, accepted):
    fields = {"prompt": "x", **context(name), name: value}
    wire = json.dumps(fields)
    if accepted:
        assert getattr(build_job(**fields), name) == value
        job = parse_job(wire)
        assert getattr(job, name) == value
        assert getattr(job.to_sampling_params(), name) == value  # and the engine takes what the job took
    else:
        with pytest.raises(JobRejected, match=rf"^invalid job: {name}: [^;]*$"):  # this field, and only it
            build_job(**fields)
        with pytest.raises(JobRejected, match=rf"^invalid job: {name}: [^;]*$"):
            parse_job(wire)


GATEWAY_CASES = [
    pytest.param(request, field, value, accepted, id=f"{request.__name__}.{field}={value!r}-{accepted}")
    for name, limit in SAMPLING_LIMITS.items()
    for field in limit.openai
    for request in GATEWAY_BODIES
    # chat's logprobs is a bool (its top_logprobs carries the count)
    if field in request.model_fields and request.model_fields[field].annotation is not bool
    for value, accepted in probes(limit.for_jobs().on_openai())  # a job's range; OpenAI's where narrower
]


@pytest.mark.parametrize("request_type, field, value, accepted", GATEWAY_CASES)
def test_the_gateway_schema_follows_the_table(request_type, field, value, accepted):
    body = {**GATEWAY_BODIES[request_type], field: value}
    for parse in (request_type.model_validate, lambda b: request_type.model_validate_json(json.dumps(b))):
        if accepted:
            assert getattr(parse(body), field) == value
        else:
            with pytest.raises(ValidationError, match=rf"1 validation error for {request_type.__name__}\n{field}\n"):
                parse(body)


def test_every_openai_name_of_the_table_is_a_gateway_field():
    requests = list(GATEWAY_BODIES)
    for limit in SAMPLING_LIMITS.values():
        for field in limit.openai:
            assert any(field in r.model_fields for r in requests), f"{limit.name}: no request has {field!r}"
    for request in (SamplingBody, *requests):  # and a request field named after a table field is its OpenAI name
        for name in request.model_fields:
            assert name not in SAMPLING_LIMITS or name in SAMPLING_LIMITS[name].openai, (request, name)


def test_the_offline_engine_takes_more_samples_than_a_job():
    """pass@k sends n in the hundreds through LLM.generate, as vLLM takes it; a job keeps the queue's bound."""
    for name in ("n", "best_of"):
        limit = SAMPLING_LIMITS[name]
        assert limit.for_jobs().high == 16 < 200 <= limit.high
        assert getattr(SamplingParams(**{name: 200}), name) == 200
        with pytest.raises(JobRejected, match=rf"^invalid job: {name}: Input should be less than or equal to 16$"):
            build_job(prompt="x", **{name: 200})


def test_a_jobs_samples_past_the_engines_max_num_seqs_wait_instead_of_being_rejected(redis_url, tiny_llama_dir):
    """A job's n within the queue's bound but past its worker's max_num_seqs: the engine queues the samples that find
    no seat (it used to refuse the job); each is the one the same seed draws alone."""
    from pagedq.engine import LLM, LLMEngine

    client = Client(redis_url)
    job = client.submit(prompt_token_ids=[5, 6, 7], n=6, max_tokens=3, temperature=1.0, seed=9, ignore_eos=True)
    run_burst(LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=32, max_num_seqs=4), redis_url)
    record = client.result(job, timeout=1)
    assert record.status == "completed" and [c.index for c in record.choices] == list(range(6))
    alone = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=32)
    for choice in record.choices:
        params = SamplingParams(max_tokens=3, temperature=1.0, seed=9 + choice.index, ignore_eos=True)
        assert choice.token_ids == alone.generate([[5, 6, 7]], params)[0].outputs[0].token_ids


def test_defaults_are_the_tables():
    engine_defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    for name, limit in SAMPLING_LIMITS.items():
        assert engine_defaults[name] == limit.default, name
        if limit.in_job:
            assert Job.model_fields[name].default == limit.default, name
        for field in limit.openai:
            for request in GATEWAY_BODIES:
                if field in request.model_fields:
                    assert request.model_fields[field].default in (limit.default, None, False), (request, field)


def test_one_list_of_sampling_fields():
    engine_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    # exactly the job's fields the engine has (the job's others are scheduling: id, prompt, priority, ...)
    assert set(SAMPLING_FIELDS) == set(Job.model_fields) & engine_fields
    assert len(SAMPLING_FIELDS) == len(set(SAMPLING_FIELDS))
    assert {name for name, limit in SAMPLING_LIMITS.items() if limit.in_job} <= set(SAMPLING_FIELDS)
    assert set(LATER_SAMPLING_DEFAULTS) <= set(SAMPLING_FIELDS)


def test_batch_state_columns_are_float_fields_of_the_table():
    from pagedq.engine.step.batch_state import _FLOATS

    assert all(SAMPLING_LIMITS[name].kind is float for name in _FLOATS)


def test_to_sampling_params():
    job = build_job(prompt="x", n=2, temperature=0.5, stop="end", seed=2**64 - 1, min_tokens=3, max_tokens=9)
    params = job.to_sampling_params()
    assert params.output_kind is RequestOutputKind.DELTA
    assert (params.n, params.best_of, params.temperature, params.stop, params.seed) == (2, 2, 0.5, ["end"], 2**64 - 1)
    assert (params.min_tokens, params.max_tokens) == (3, 9)
    assert job.to_sampling_params(RequestOutputKind.FINAL_ONLY).output_kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams(**job.sampling_kwargs()) == dataclasses.replace(
        params, output_kind=RequestOutputKind.CUMULATIVE
    )


class ParamsRecorder(StubEngine):
    """The stub engine, remembering the SamplingParams object of every request it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.given: list[tuple[str, SamplingParams]] = []

    def add_request(self, request_id, prompt, params, priority=0):
        self.given.append((request_id, params))
        return super().add_request(request_id, prompt, params, priority=priority)


def test_a_job_s_sampling_params_are_built_once_for_all_its_runs(redis_url, monkeypatch):
    """A job rerun (its batch failed beside a poison job) gets the SamplingParams its first run got: admission
    builds them once, when it prepares the job, and every run reuses them."""
    built: list[str] = []
    to_sampling_params = Job.to_sampling_params

    def counting(self: Job, *args: Any, **kwargs: Any) -> SamplingParams:
        built.append(self.id)
        return to_sampling_params(self, *args, **kwargs)

    monkeypatch.setattr(Job, "to_sampling_params", counting)
    client = Client(redis_url)
    fine = client.submit(prompt="fine", max_tokens=4, temperature=0.0, top_k=5)
    poison = client.submit(prompt="this is POISON", max_tokens=4)
    recorder = ParamsRecorder()
    run_burst(FaultyEngine(recorder, "POISON"), redis_url, max_attempts=2)
    assert client.result(fine, timeout=1).status == "completed"
    assert client.result(poison, timeout=1).status == "failed"
    assert sorted(built) == sorted([fine, poison])
    runs = [params for request_id, params in recorder.given if request_id.endswith("/" + fine)]
    assert len(runs) >= 2 and all(params is runs[0] for params in runs)
    assert runs[0].top_k == 5 and runs[0].output_kind is RequestOutputKind.DELTA
