"""The Celery front door with a real Celery producer and a real Redis: results equal the native client's for
the same job, bad kwargs fail the task with the reason, a group gets every result, and the messages of a
worker killed with -9 are redelivered after the visibility timeout and answered once."""

from __future__ import annotations

import importlib
import signal

import pytest
from celery import group
from celery.result import AsyncResult

from pagedq.worker import Client, JobRejected
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import finals_by_id, offline, start_worker, worker_thread

SAME = ("status", "text", "token_ids", "finish_reason", "stop_reason", "usage", "metadata", "error", "logprobs")


def assert_clean_celery(r, queue: str = "pagedq") -> None:
    """Nothing left on the Celery side: the queue list is empty and no message is unacknowledged."""
    assert r.llen(queue) == 0
    assert r.hlen("unacked") == 0 and r.zcard("unacked_index") == 0
    assert r.hlen("pagedq:{default}:celery:deliveries") == 0


def test_celery_round_trip_equals_native(redis_url, r, monkeypatch):
    monkeypatch.setenv("PAGEDQ_REDIS_URL", redis_url)
    import pagedq.worker.celery.app as celery_app

    celery_app = importlib.reload(celery_app)  # the module's app reads its broker URL at import
    from pagedq.worker.celery.app import app, generate

    client = Client(redis_url)
    with worker_thread(StubEngine(), redis_url, celery_broker=redis_url, celery_poll_s=0.01):
        job = dict(prompt="the same job", max_tokens=7, temperature=0, metadata={"k": [1, 2]})
        via_celery = generate.delay(**job).get(timeout=20)
        native = client.result(client.submit(**job), timeout=20).model_dump()
        assert {k: via_celery[k] for k in SAME} == {k: native[k] for k in SAME}
        assert set(via_celery) == set(native) and via_celery["status"] == "completed"
        assert via_celery["text"] == offline("the same job", max_tokens=7, temperature=0.0)[0]

        # send_task with the prompt as positional argument; a seeded sampled job, same on both paths
        sent = app.send_task("pagedq.generate", args=["seeded"], kwargs=dict(max_tokens=9, temperature=0.8, seed=5))
        seeded = client.result(client.submit(prompt="seeded", max_tokens=9, temperature=0.8, seed=5), timeout=20)
        assert sent.get(timeout=20)["token_ids"] == seeded.token_ids

        # issue 20's fields: logit_bias keys arrive as JSON strings, and are token ids again in the job
        biased = generate.delay(prompt="bias", max_tokens=4, logit_bias={7: 50.0}, best_of=2, seed=1).get(timeout=20)
        assert biased["status"] == "completed" and len(biased["token_ids"]) == 4
        # issue 19's structured_outputs: carried as a kwarg (the stub engine does not constrain; the field reaches it)
        shaped = generate.delay(prompt="json", max_tokens=4, structured_outputs={"json": {"type": "object"}})
        assert shaped.get(timeout=20)["status"] == "completed"

        # bad kwargs: FAILURE with the reason, re-raised by get(); the worker keeps serving
        bad = [
            generate.delay(prompt="x", max_tokenz=3),
            generate.delay(prompt="   "),
            generate.delay(prompt="x", temperature=-1),
            app.send_task("pagedq.generate", args=["a", "b"]),
            generate.delay(prompt="x", structured_outputs={"choice": []}),
        ]
        reasons = [
            "max_tokenz",
            "prompt must not be empty",
            "temperature",
            "only positional argument",
            "choice must be a non-empty list",
        ]
        for res, reason in zip(bad, reasons):
            try:
                res.get(timeout=20)
            except JobRejected as exc:
                assert reason in str(exc)
            else:
                raise AssertionError(f"{reason}: no failure")
            assert res.state == "FAILURE" and reason in str(res.result)

        # task ids outside the job id grammar: FAILURE, and no pagedq key is ever named after them
        for task_id in ("k}{z", "line\nbreak", "x" * 201):
            res = app.send_task("pagedq.generate", kwargs=dict(prompt="x", max_tokens=2), task_id=task_id)
            try:
                res.get(timeout=20)
            except JobRejected as exc:
                assert "invalid task id" in str(exc)
            else:
                raise AssertionError(f"task id {task_id!r} was accepted")
        assert [k for k in r.keys("pagedq:*") if b"k}{z" in k or b"\n" in k or b"x" * 201 in k] == []

        # a group over document chunks: every result, each equal to the engine's answer for its chunk
        chunks = [f"chunk {i} of the document" for i in range(40)]
        results = group(generate.s(prompt=c, max_tokens=5, temperature=0) for c in chunks)().get(timeout=60)
        assert [res["text"] for res in results] == [offline(c, max_tokens=5, temperature=0.0)[0] for c in chunks]
        assert client.cancel(results[0]["id"]) is False  # the task id is the job id: same final record
    finals = finals_by_id(r)
    assert all(len(records) == 1 for records in finals.values())
    assert len(finals) == 1 + 1 + 1 + 1 + 1 + 1 + len(bad) + len(chunks)
    assert_clean_celery(r)


@pytest.mark.slow  # starts and kills `pagedq worker` processes
def test_killed_worker_messages_are_redelivered_and_answered_once(redis_url, r, tmp_path):
    from pagedq.worker.celery.app import make_app

    app = make_app(redis_url, visibility_timeout_s=2)
    generate = app.tasks["pagedq.generate"]
    prompts = [f"celery crash {i}" for i in range(24)]
    results = [generate.delay(prompt=p, max_tokens=30, temperature=0) for p in prompts]
    stub = [
        "--engine",
        "stub",
        "--stub-step-delay",
        "0.02",
        "--max-num-seqs",
        "4",
        "--max-waiting",
        "4",
        "--celery",
        "--celery-visibility-timeout",
        "2",
    ]
    # The first worker dies abruptly (os._exit, like kill -9) as soon as job 9 enters its engine: a crash in
    # mid-step, with jobs running and read ahead. (A kill at a random moment could also land in kombu's own
    # gap between RPOP and its write to the unacked hash, where Celery on Redis loses the message whoever
    # consumes it: documented in docs/celery.md, and not what this test is about.)
    crash = {"PAGEDQ_FAULT_PROMPT": "celery crash 9", "PAGEDQ_FAULT_MODE": "exit"}
    first = start_worker(redis_url, *stub, "--name", "a", log=tmp_path / "a.log", faults=crash)
    assert first.wait(timeout=60) == 86  # faults.FaultyEngine's exit status
    in_flight = r.hlen("unacked")
    assert in_flight > 0, "the killed worker should have held unacknowledged Celery messages"
    done_before = {res.id for res in results if res.ready()}
    second = start_worker(redis_url, *stub, "--name", "b", log=tmp_path / "b.log")
    try:
        answers = [res.get(timeout=60) for res in results]
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0
    for prompt, res, answer in zip(prompts, results, answers):
        assert answer["status"] == "completed" and answer["id"] == res.id
        assert answer["text"] == offline(prompt, max_tokens=30, temperature=0.0)[0]
        assert AsyncResult(res.id, app=app).state == "SUCCESS"
    finals = finals_by_id(r)  # one final record per task id, whoever ran it
    assert set(finals) == {res.id for res in results} and all(len(v) == 1 for v in finals.values())
    by_b = {job_id for job_id, records in finals.items() if records[0]["worker"] == "b"}
    assert by_b and not by_b & done_before  # the survivor answered the rest, nothing answered twice
    assert_clean_celery(r)
