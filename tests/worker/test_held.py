"""One identity (origin, job id) and one state per held job, against a real Redis: the same job id in two
bands or from Celery and a stream is two held jobs, each acknowledged where it came from; a second entry of a
held job in its band is acknowledged without a second run; a job cancelled in the backlog never reaches the
engine. Oracles: the stub engine's offline output, the engine's own record of the requests it was given, and
Redis' pending lists."""

from __future__ import annotations

import importlib
import json

import pytest

from pagedq.worker import Client
from pagedq.worker.protocol.job import parse_job
from pagedq.worker.service.held import HeldJob, HeldJobs, IllegalMove, JobKey, JobState
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import KEYS, finals_by_id, offline, run_burst, wait_for, worker_thread


class RecordingEngine(StubEngine):
    """The stub engine, remembering every request id it was handed."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.added: list[str] = []

    def add_request(self, request_id, prompt, params, priority=0):
        self.added.append(request_id)
        return super().add_request(request_id, prompt, params, priority=priority)


def raw_job(**fields) -> dict:
    return {"job": json.dumps(fields)}


def assert_acknowledged(r, *bands: str) -> None:
    for band in bands:
        assert r.xlen(KEYS.jobs_of(band)) == 0 and r.xpending(KEYS.jobs_of(band), "workers")["pending"] == 0


def test_the_same_job_id_in_two_bands_is_two_held_jobs(redis_url, r):
    job = dict(id="twin", prompt="twins", max_tokens=6, temperature=0.0)
    r.xadd(KEYS.jobs_of("interactive"), raw_job(**job), id="5-1")  # the same entry id in both streams too
    r.xadd(KEYS.jobs_of("bulk"), raw_job(**job), id="5-1")
    engine = RecordingEngine()
    worker = run_burst(engine, redis_url)
    assert sorted(engine.added) == ["bulk/twin", "interactive/twin"]
    assert_acknowledged(r, "interactive", "bulk")
    records = finals_by_id(r)["twin"]
    assert len(records) == 1 and records[0]["text"] == offline("twins", max_tokens=6, temperature=0.0)[0]
    assert worker.publisher.duplicates == 1  # the second run's record lost to the first (FINALIZE)


def test_a_second_entry_of_a_held_job_is_acknowledged_without_a_second_run(redis_url, r):
    for _ in range(2):
        r.xadd(KEYS.jobs, raw_job(id="again", prompt="once", max_tokens=5, temperature=0.0))
    r.xadd(KEYS.jobs, raw_job(id="other", prompt="other", max_tokens=5, temperature=0.0))
    engine = RecordingEngine()
    worker = run_burst(engine, redis_url)
    assert sorted(engine.added) == ["default/again", "default/other"]
    assert_acknowledged(r, "default")
    finals = finals_by_id(r)
    assert [rec["text"] for rec in finals["again"]] == [offline("once", max_tokens=5, temperature=0.0)[0]]
    assert worker.publisher.duplicates == 0 and worker.stats["completed"] == 2


def test_a_cancelled_backlog_job_never_reaches_the_engine(redis_url, r):
    client = Client(redis_url)
    engine = RecordingEngine(max_num_seqs=2, step_delay_s=0.01)
    # reserve_seqs=1: the bulk band gets one of the two slots, so the second bulk job waits in the backlog
    with worker_thread(engine, redis_url, reserve_seqs=1) as worker:
        running = client.submit(prompt="long", max_tokens=300, ignore_eos=True, band="bulk")
        queued = client.submit(prompt="never runs", max_tokens=4, band="bulk")
        held = wait_for(lambda: worker.held.get(JobKey("bulk", queued)), what="the second job held")
        wait_for(
            lambda: held.state is JobState.BACKLOG and worker.held.get(JobKey("bulk", running)).in_engine,
            what="one job running, the other in the backlog",
        )
        assert client.cancel(queued)
        record = client.result(queued, timeout=10)
        assert (record.status, record.text, record.attempts) == ("cancelled", "", 0)
        assert held.state is JobState.FINAL and JobKey("bulk", queued) not in worker.held
        assert client.result(running, timeout=20).status == "completed"
    assert engine.added == [f"bulk/{running}"]
    assert_acknowledged(r, "bulk")


def test_celery_and_a_stream_with_the_same_job_id_are_kept_apart(redis_url, r, monkeypatch):
    monkeypatch.setenv("PAGEDQ_REDIS_URL", redis_url)
    import pagedq.worker.celery.app as celery_app

    importlib.reload(celery_app)  # the module's app reads its broker URL at import
    from pagedq.worker.celery.app import generate

    engine = RecordingEngine(step_delay_s=0.005)
    client = Client(redis_url)
    with worker_thread(engine, redis_url, celery_broker=redis_url, celery_poll_s=0.01):
        job = dict(prompt="shared id", max_tokens=40, temperature=0.0, ignore_eos=True)
        client.submit(job_id="shared", **job)
        via_celery = generate.apply_async(kwargs=job, task_id="shared")
        expected = offline("shared id", max_tokens=40, temperature=0.0, ignore_eos=True)[0]
        assert via_celery.get(timeout=20)["text"] == expected
        assert client.result("shared", timeout=20).text == expected
        wait_for(lambda: len(engine.added) == 2 and not engine.has_unfinished_requests(), what="both runs")
    assert sorted(engine.added) == ["celery/shared", "default/shared"]
    assert_acknowledged(r, "default")
    assert r.llen("pagedq") == 0 and r.hlen("unacked") == 0


def test_moves_outside_the_state_model_are_refused():
    job = parse_job(json.dumps({"id": "j", "prompt": "p"}))
    held = HeldJobs()
    t = HeldJob(JobKey("default", "j"), job, entry_id="1-1")
    held.add(t)
    with pytest.raises(IllegalMove, match="already held"):
        held.add(HeldJob(JobKey("default", "j"), job, entry_id="1-2"))
    held.add(HeldJob(JobKey("bulk", "j"), job, entry_id="1-1"))  # another origin: another job
    assert len(held) == 2 and [x.state for x in held.waiting()] == [JobState.BACKLOG] * 2
    t.move(JobState.IN_ENGINE)
    t.alone = t.started = True
    t.move(JobState.SUSPECT)  # a failed step: back to waiting, no longer alone or started
    assert (t.alone, t.started) == (False, False)
    held.finish(t)
    assert JobKey("default", "j") not in held and t.state is JobState.FINAL
    with pytest.raises(IllegalMove, match="final -> in_engine"):
        t.move(JobState.IN_ENGINE)


class BudgetWatchingEngine(StubEngine):
    """The stub engine, noting before each step how many waiting requests the free KV blocks cannot take."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.most_over_budget = 0

    def step(self):
        free, over = self.num_free_blocks, 0
        for req in sorted(self._waiting, key=lambda q: (q.priority, q.seq)):
            need = self.blocks_needed(len(req.prompt_ids), req.params.max_tokens)
            if need <= free:
                free -= need
            else:
                over += 1
        self.most_over_budget = max(self.most_over_budget, over)
        return super().step()


def test_admission_hands_over_only_what_the_free_kv_blocks_take(redis_url, r):
    """The engine's own block count, not a guess from the prompt's bytes: the stub makes one token per byte,
    where a 4-bytes-per-token guess let four 9-block jobs into 18 free blocks."""
    client = Client(redis_url)
    prompts = [f"{i:03d} " + "x" * 124 for i in range(10)]  # 128 bytes: 128 tokens, 8 blocks + 1 for output
    ids = client.submit_many([dict(prompt=p, max_tokens=16, temperature=0.0) for p in prompts])
    engine = BudgetWatchingEngine(num_kv_blocks=18, max_num_seqs=8, step_delay_s=0.002)
    run_burst(engine, redis_url)
    # at most the one job let through when nothing else waits (it queues for blocks in the engine)
    assert engine.most_over_budget <= 1
    for job_id, prompt in zip(ids, prompts):
        assert client.result(job_id, timeout=1).text == offline(prompt, max_tokens=16, temperature=0.0)[0]
    assert_acknowledged(r, "default")
