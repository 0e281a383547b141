"""The batch line format (worker/bulk/lines.py): every job field a line may set reaches the job."""

from __future__ import annotations

import json

import pytest

from worker.bulk.lines import LineError, parse_request
from worker.client.core import make_job
from worker.protocol.errors import JobRejected


def _openai_line(**body: object) -> str:
    request = {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", **body}}
    return json.dumps(request)


def test_penalties_and_min_tokens_of_an_openai_body_reach_the_job() -> None:
    line = _openai_line(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1, min_tokens=2)
    custom_id, fields, kind, model = parse_request(line)
    job = make_job(job_id="j1", **fields)
    assert (custom_id, kind, model) == ("c1", "completion", None)
    assert (job.presence_penalty, job.frequency_penalty, job.repetition_penalty, job.min_tokens) == (0.5, 0.25, 1.1, 2)


def test_a_plain_line_takes_the_same_fields() -> None:
    _, fields, _, _ = parse_request(json.dumps({"custom_id": "p", "prompt": "hi", "frequency_penalty": 1.0}))
    assert make_job(job_id="j2", **fields).frequency_penalty == 1.0


@pytest.mark.parametrize("line", [_openai_line(n=2), json.dumps({"custom_id": "p", "prompt": "hi", "n": 2})])
def test_n_above_one_is_refused_on_either_form(line: str) -> None:
    with pytest.raises(LineError) as caught:
        parse_request(line)
    assert caught.value.code == "invalid_request"


@pytest.mark.parametrize(
    "line",
    [
        _openai_line(logit_bias={"28": 100, "5": -100}, best_of=3, include_stop_str_in_output=True),
        json.dumps(
            {
                "custom_id": "p",
                "prompt": "hi",
                "logit_bias": {"28": 100, "5": -100},
                "best_of": 3,
                "include_stop_str_in_output": True,
            }
        ),
    ],
)
def test_logit_bias_and_best_of_reach_the_job_on_either_form(line: str) -> None:
    _, fields, _, _ = parse_request(line)
    params = make_job(job_id="j3", **fields).to_sampling_params()
    assert (params.logit_bias, params.best_of, params.n) == ({28: 100.0, 5: -100.0}, 3, 1)
    assert params.include_stop_str_in_output


def test_a_logit_bias_out_of_bounds_is_refused() -> None:
    from worker.protocol.errors import JobRejected

    _, fields, _, _ = parse_request(_openai_line(logit_bias={"28": 101}))
    with pytest.raises(JobRejected, match="logit_bias"):
        make_job(job_id="j4", **fields)


SCHEMA = {"type": "object", "properties": {"total": {"type": "number"}}, "required": ["total"]}


@pytest.mark.parametrize(
    "line, expected",
    [
        (_openai_line(response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}), SCHEMA),
        (_openai_line(response_format={"type": "json_object"}), True),
        (_openai_line(structured_outputs={"json": SCHEMA}), SCHEMA),
        (json.dumps({"custom_id": "p", "prompt": "hi", "structured_outputs": {"json": SCHEMA}}), SCHEMA),
    ],
)
def test_structured_outputs_and_response_format_reach_the_job(line: str, expected: object) -> None:
    _, fields, _, _ = parse_request(line)
    job = make_job(job_id="j4", **fields)
    assert job.structured_outputs == ({"json_object": True} if expected is True else {"json": expected})
    assert job.to_sampling_params().structured_outputs is not None


def test_a_bad_constraint_on_a_line_is_refused_naming_it() -> None:
    with pytest.raises(LineError, match="each constrain the output"):
        parse_request(_openai_line(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}))
    with pytest.raises(LineError, match="json_schema with a schema"):
        parse_request(_openai_line(response_format={"type": "json_schema", "json_schema": {"name": "t"}}))
    _, fields, _, _ = parse_request(_openai_line(structured_outputs={"choice": []}))
    with pytest.raises(JobRejected, match="choice must be a non-empty list"):
        make_job(job_id="j5", **fields)
