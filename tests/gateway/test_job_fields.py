"""The job fields the gateway added (n, presence/frequency/repetition penalty, min_tokens): bounded, and left
out of the job JSON at their defaults so workers that predate them still accept such jobs."""

from __future__ import annotations

import json

import pytest

from pagedq.worker.protocol.errors import JobRejected
from pagedq.worker.protocol.job import Job, build_job

OLD_FIELDS = set(Job.model_fields) - {"n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"}


def test_defaults_are_not_sent_and_set_values_round_trip():
    plain = json.loads(build_job(prompt="hi").to_json())
    assert set(plain) <= OLD_FIELDS  # what an older worker (extra="forbid") accepts
    job = build_job(
        prompt="hi",
        n=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.3,
        min_tokens=2,
        max_tokens=8,
    )
    again = Job.model_validate_json(job.to_json())
    assert again == job
    assert {k: again.sampling_kwargs()[k] for k in ("n", "presence_penalty", "min_tokens")} == {
        "n": 3,
        "presence_penalty": 0.5,
        "min_tokens": 2,
    }


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 17),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 11.0),
        ("min_tokens", -1),
        ("min_tokens", 20),
    ],
)
def test_out_of_bounds_values_are_rejected_naming_the_field(field, value):
    with pytest.raises(JobRejected, match=field):
        build_job(prompt="hi", max_tokens=16, **{field: value})
