"""Celery parity with a real Celery producer and a real Redis: `AsyncResult.revoke()` (with and without
terminate) before any worker read the message and while it runs, `expires` passing before and during the run,
a plain producer app with the documented task_routes, and a worker serving several queues like `-Q a,b`."""

from __future__ import annotations

import datetime as dt
import json
import time

import pytest
from celery import Celery
from celery.exceptions import TaskRevokedError

from pagedq.worker.celery.app import make_app, parse_queues
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import offline, wait_for, worker_thread
from .test_celery import assert_clean_celery

KEYS = QueueKeys("default")


class RecordingEngine(StubEngine):
    """The stub engine, remembering every request it was given (a revoked job must never get here)."""

    def __init__(self, step_delay_s: float = 0.0, max_num_seqs: int = 256) -> None:
        super().__init__(step_delay_s=step_delay_s, max_num_seqs=max_num_seqs)
        self.added: list[str] = []

    def add_request(self, request_id, *args, **kwargs):
        self.added.append(request_id)
        return super().add_request(request_id, *args, **kwargs)


def final_record(r, job_id: str) -> dict:
    raw = wait_for(lambda: r.get(KEYS.final(job_id)), timeout=20, what=f"final record of {job_id}")
    return json.loads(raw)


def assert_revoked(res, reason: str) -> None:
    wait_for(lambda: res.state == "REVOKED", timeout=20, what=f"{res.id} REVOKED")
    assert isinstance(res.result, TaskRevokedError) and str(res.result) == reason
    with pytest.raises(TaskRevokedError):
        res.get(timeout=5)


def test_revoke_before_any_worker_read_it_is_never_generated(redis_url, r):
    app = make_app(redis_url)
    res = app.tasks["pagedq.generate"].apply_async(kwargs=dict(prompt="never run me", max_tokens=5))
    # a worker serving another queue gets the broadcast but never sees the message
    with worker_thread(
        RecordingEngine(), redis_url, celery_broker=redis_url, celery_queue="elsewhere", celery_poll_s=0.01
    ):
        res.revoke()
        assert_revoked(res, "revoked")  # stored at once, as Celery's revoke handler does for a PENDING task
        assert r.llen("pagedq") == 1 and r.zscore(KEYS.cancelled, res.id) is not None
    # a worker started later reads the message, finds it in the shared revoked (cancel) set, discards it
    engine = RecordingEngine()
    with worker_thread(engine, redis_url, name="later", celery_broker=redis_url, celery_poll_s=0.01):
        record = final_record(r, res.id)
        wait_for(lambda: r.llen("pagedq") == 0 and r.hlen("unacked") == 0, what="message acknowledged")
    assert record["status"] == "cancelled" and record["token_ids"] == [] and engine.added == []
    assert_revoked(res, "revoked")
    assert_clean_celery(r)


@pytest.mark.parametrize("terminate", [False, True])
def test_revoke_stops_a_running_job(redis_url, r, terminate):
    app = make_app(redis_url)
    engine = RecordingEngine(step_delay_s=0.01)
    with worker_thread(engine, redis_url, celery_broker=redis_url, celery_poll_s=0.01):
        res = app.tasks["pagedq.generate"].apply_async(kwargs=dict(prompt="a long story", max_tokens=1500))
        wait_for(lambda: f"celery/{res.id}" in engine.added, what="job running")
        time.sleep(0.2)  # some tokens out
        started = time.monotonic()
        res.revoke(terminate=terminate)
        record = final_record(r, res.id)
        took = time.monotonic() - started
        assert_revoked(res, "revoked")
        after = res.app.tasks["pagedq.generate"].delay(prompt="next", max_tokens=3, temperature=0).get(timeout=20)
    assert record["status"] == "cancelled" and record["error"] == "cancelled by request"
    assert 0 < len(record["token_ids"]) < 1500 and took < 2.0, (len(record["token_ids"]), took)
    assert after["text"] == offline("next", max_tokens=3, temperature=0.0)[0]  # the worker keeps serving
    assert_clean_celery(r)


def test_revoke_of_a_job_waiting_behind_another(redis_url, r):
    app = make_app(redis_url)
    generate = app.tasks["pagedq.generate"]
    engine = RecordingEngine(step_delay_s=0.01, max_num_seqs=1)  # one at a time: the second one waits
    with worker_thread(engine, redis_url, celery_broker=redis_url, celery_poll_s=0.01) as worker:
        first = generate.apply_async(kwargs=dict(prompt="first in line", max_tokens=60, temperature=0))
        second = generate.apply_async(kwargs=dict(prompt="second in line", max_tokens=60))
        wait_for(lambda: len(worker.held) == 2, what="both read by the worker")
        second.revoke()
        assert_revoked(second, "revoked")
        answer = first.get(timeout=20)
    assert final_record(r, second.id)["token_ids"] == []  # revoked while waiting: nothing generated
    assert answer["status"] == "completed"  # the job ahead of it is untouched
    assert answer["text"] == offline("first in line", max_tokens=60, temperature=0.0)[0]
    assert_clean_celery(r)


def test_expires_stores_revoked_and_the_record_says_expired(redis_url, r):
    app = make_app(redis_url)
    generate = app.tasks["pagedq.generate"]
    engine = RecordingEngine(step_delay_s=0.01)
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=5)
    with worker_thread(engine, redis_url, celery_broker=redis_url, celery_poll_s=0.01):
        stale = generate.apply_async(kwargs=dict(prompt="too late", max_tokens=5), expires=past)
        running = generate.apply_async(kwargs=dict(prompt="runs out of time", max_tokens=1500), expires=1.0)
        before, during = final_record(r, stale.id), final_record(r, running.id)
        assert_revoked(stale, "expired")
        assert_revoked(running, "expired")
    assert before["status"] == "expired" and before["token_ids"] == []
    assert f"celery/{stale.id}" not in engine.added
    assert during["status"] == "expired" and 0 < len(during["token_ids"]) < 1500
    assert during["error"] == "deadline passed while running"
    assert_clean_celery(r)


def test_plain_producer_with_task_routes_and_a_worker_serving_two_queues(redis_url, r):
    job = dict(prompt="plain producer", max_tokens=6, temperature=0)
    expected = offline("plain producer", max_tokens=6, temperature=0.0)[0]
    routed = Celery(
        "x",
        broker=redis_url,
        backend=redis_url,
        set_as_current=False,
        task_routes={"pagedq.generate": {"queue": "pagedq"}},
    )  # the producer snippet of docs/celery.md
    plain = Celery("y", broker=redis_url, backend=redis_url, set_as_current=False)  # Celery's default queue
    with worker_thread(StubEngine(), redis_url, celery_broker=redis_url, celery_poll_s=0.01):
        assert routed.send_task("pagedq.generate", kwargs=job).get(timeout=20)["text"] == expected
        assert plain.control.ping(timeout=1.0) == [{"pagedq@w-test": {"ok": "pong"}}]
    unrouted = plain.send_task("pagedq.generate", kwargs=job)
    foreign = plain.send_task("other_app.resize_image", args=[1])
    time.sleep(0.3)
    assert unrouted.state == "PENDING" and r.llen("celery") == 2  # a pagedq-only worker leaves `celery` alone

    with worker_thread(
        StubEngine(), redis_url, name="two", celery_broker=redis_url, celery_queue="pagedq, celery", celery_poll_s=0.01
    ) as worker:
        assert worker.celery is not None and worker.celery.name == "pagedq,celery"
        assert unrouted.get(timeout=20)["text"] == expected
        # it owns the queues it serves, like a Celery worker: a task it does not know fails (and is acked)
        with pytest.raises(Exception, match=r"unknown task 'other_app\.resize_image'"):
            foreign.get(timeout=20)
        assert routed.send_task("pagedq.generate", kwargs=job).get(timeout=20)["text"] == expected
    assert foreign.state == "FAILURE"
    assert_clean_celery(r)
    assert_clean_celery(r, queue="celery")


def test_queue_lists_are_checked():
    assert parse_queues("pagedq") == ["pagedq"] and parse_queues(" a , b ") == ["a", "b"]
    with pytest.raises(ValueError, match="empty name"):
        parse_queues("pagedq,")
    with pytest.raises(ValueError, match="names a queue twice"):
        parse_queues("a,b,a")
