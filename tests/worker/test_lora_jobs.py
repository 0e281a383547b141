"""LoRA adapters through the queue (issue 36) on the stub engine: a job's `lora`, the worker's --lora-modules and the
queue's registry (protocol/registry.py), the errors, and the per-adapter figures. The real engine's outputs through
every front door: tests/worker/test_lora_real.py."""

from __future__ import annotations

import json

import pytest

from pagedq.worker import Client
from pagedq.worker.cli.main import add_worker_args
from pagedq.worker.flags import SettingsParser
from pagedq.worker.protocol import registry
from pagedq.worker.protocol.errors import JobRejected
from pagedq.worker.protocol.job import build_job, parse_job
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.protocol.limits import MAX_REGISTERED_LORAS
from pagedq.worker.protocol.registry import parse_lora_modules
from pagedq.worker.service.engine_api import LoRARequest, RequestOutputKind, RequestRejected, SamplingParams
from pagedq.worker.service.held import HeldJob, JobKey, JobState
from pagedq.worker.service.loras import OTHER, WorkerLoras
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import KEYS, run_burst, scrape, wait_for, worker_thread

GREEDY = {"max_tokens": 8, "temperature": 0.0}


def _alone(prompt: str, lora: LoRARequest | None = None) -> str:
    """The stub engine's answer for one request run alone: the oracle for the worker."""
    engine = StubEngine()
    if lora is not None:
        engine.add_lora(lora)
    engine.add_request("x", prompt, SamplingParams(**GREEDY, output_kind=RequestOutputKind.CUMULATIVE), lora=lora)
    while True:
        for out in engine.step():
            if out.finished:
                return out.outputs[0].text


def _adapter(tmp_path, name: str) -> str:
    folder = tmp_path / name
    folder.mkdir()
    return str(folder)


def test_the_job_field_is_bounded_and_sent_only_when_set():
    assert "lora" not in json.loads(build_job(prompt="x").to_json())
    assert json.loads(build_job(prompt="x", lora="org/sql-v2").to_json())["lora"] == "org/sql-v2"
    for bad in ("", "has space", "-dash-first", "x" * 129, "quote'"):
        with pytest.raises(JobRejected, match="lora"):
            build_job(prompt="x", lora=bad)
    with pytest.raises(JobRejected, match="lora"):
        parse_job(json.dumps({"prompt": "x", "lora": 7}))


def test_lora_modules_flag_and_variable(monkeypatch):
    parser = SettingsParser()
    add_worker_args(parser)
    args = parser.parse_args(["--lora-modules", "a=/x", "b=/y", "--lora-modules", "c=/z"])
    assert parse_lora_modules(args.lora_modules) == {"a": "/x", "b": "/y", "c": "/z"}
    monkeypatch.setenv("PAGEDQ_LORA_MODULES", "a=/x,b=/y")
    assert parse_lora_modules(parser.parse_args([]).lora_modules) == {"a": "/x", "b": "/y"}
    with pytest.raises(ValueError, match="not name=path"):
        parse_lora_modules(["a"])
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="LoRA adapter name"):
        parse_lora_modules(["bad name=/x"])


def test_jobs_run_with_their_adapter(redis_url, r, tmp_path):
    """Each job's output is the engine's own with the same adapter, and differs from the base model's; a job naming an
    adapter nobody registered, or one that cannot load, gets one rejected record naming it, and the others run."""
    sql, chat = _adapter(tmp_path, "sql"), _adapter(tmp_path, "chat")
    client = Client(redis_url)
    registry.register(r, KEYS, "chat", chat)
    registry.register(r, KEYS, "broken", str(tmp_path / "missing"))
    ids = {
        "base": client.submit("hello there", **GREEDY),
        "sql": client.submit("hello there", lora="sql", **GREEDY),
        "chat": client.submit("hello there", lora="chat", **GREEDY),
        "unknown": client.submit("hello there", lora="nobody", **GREEDY),
        "broken": client.submit("hello there", lora="broken", **GREEDY),
    }
    run_burst(StubEngine(), redis_url, lora_modules=[f"sql={sql}"])
    got = {name: client.result(job_id, timeout=5) for name, job_id in ids.items()}
    assert got["base"].text == _alone("hello there")
    assert got["sql"].text == _alone("hello there", LoRARequest("sql", sql))
    assert got["chat"].text == _alone("hello there", LoRARequest("chat", chat))
    assert len({got["base"].text, got["sql"].text, got["chat"].text}) == 3
    assert got["unknown"].status == "rejected" and "unknown LoRA adapter 'nobody'" in got["unknown"].error
    assert got["broken"].status == "rejected" and "'broken'" in got["broken"].error
    assert "is not a folder" in got["broken"].error


def test_a_broken_adapter_is_read_once_while_its_jobs_flood_in(redis_url, r, tmp_path, monkeypatch):
    """Jobs naming an adapter that failed to load are refused with the same reason without reading its folder
    again, until RETRY_FAILED_S has passed (its folder may have appeared by then)."""
    from pagedq.worker.service import loras
    from pagedq.worker.service.context import ServiceContext

    from .helpers import fast_settings

    engine, missing = StubEngine(), tmp_path / "later"
    calls = []
    real_add = engine.add_lora
    monkeypatch.setattr(engine, "add_lora", lambda lora: (calls.append(lora.name), real_add(lora)))
    registry.register(r, KEYS, "later", str(missing))
    client = Client(redis_url)
    ids = [client.submit("hi", lora="later", **GREEDY) for _ in range(5)]
    run_burst(engine, redis_url)
    assert {client.result(i, timeout=5).status for i in ids} == {"rejected"} and calls == ["later"]

    adapters = loras.WorkerLoras(ServiceContext.build(r, fast_settings()), engine)
    monkeypatch.setattr(loras, "RETRY_FAILED_S", 0.2)
    for _ in range(3):
        with pytest.raises(RequestRejected, match="is not a folder"):
            adapters.request_for("later")
    missing.mkdir()
    with pytest.raises(RequestRejected):  # within the retry time: the same answer, the folder unread
        adapters.request_for("later")
    assert calls == ["later", "later"]

    def served() -> bool:
        try:
            return bool(adapters.request_for("later"))
        except RequestRejected:
            return False

    wait_for(served, timeout=2, interval=0.05, what="the retry, once RETRY_FAILED_S has passed")
    assert calls == ["later", "later", "later"]


def test_a_bad_start_module_stops_the_start(redis_url, tmp_path):
    with pytest.raises(ValueError, match="--lora-modules: LoRA adapter 'gone'"):
        run_burst(StubEngine(), redis_url, lora_modules=[f"gone={tmp_path / 'nothing'}"])


def test_unregistering_reaches_the_worker(redis_url, r, tmp_path):
    """An adapter registered while the worker runs is served on first use; once unregistered the worker drops it
    from its engine and rejects the jobs naming it."""
    engine, path = StubEngine(), _adapter(tmp_path, "late")
    client = Client(redis_url)
    with worker_thread(engine, redis_url):
        assert registry.register(r, KEYS, "late", path) is True
        first = client.result(client.submit("hi", lora="late", **GREEDY), timeout=10)
        assert first.status == "completed" and first.text == _alone("hi", LoRARequest("late", path))
        assert engine.list_loras() == [LoRARequest("late", path)]
        assert registry.unregister(r, KEYS, "late") is True
        wait_for(lambda: not engine.list_loras(), timeout=10, what="the worker to drop the adapter")
        after = client.result(client.submit("hi", lora="late", **GREEDY), timeout=10)
        assert after.status == "rejected" and "unknown LoRA adapter 'late'" in after.error
    assert registry.unregister(r, KEYS, "late") is False


def test_the_registry_is_bounded(r):
    keys = QueueKeys("bounded")
    pipe = r.pipeline()
    for i in range(MAX_REGISTERED_LORAS):
        pipe.hset(keys.loras, f"a{i}", json.dumps({"path": "/x"}))
    pipe.execute()
    with pytest.raises(registry.RegistryFull):
        registry.register(r, keys, "one-more", "/x")
    assert registry.register(r, keys, "a0", "/elsewhere") is False  # taken: nothing written
    assert json.loads(r.hget(keys.loras, "a0"))["path"] == "/x"
    with pytest.raises(ValueError, match="path"):
        registry.register(r, keys, "b", "x" * 5000)


def test_figures_cap_the_adapters_named(redis_url, r, tmp_path, monkeypatch):
    """Per-adapter counts reach the heartbeat, `pagedq status` and the metrics (ours and vLLM's lora_requests_info);
    past the cap the rest are summed under one label."""
    from pagedq.worker.ops.status import queue_status, render
    from pagedq.worker.service import loras

    monkeypatch.setattr(loras, "MAX_SHOWN", 2)
    modules = [f"a{i}={_adapter(tmp_path, f'a{i}')}" for i in range(3)]
    client = Client(redis_url)
    ids = [client.submit("hey", lora=f"a{i}", **GREEDY) for i in range(3) for _ in range(i + 1)]
    with worker_thread(StubEngine(), redis_url, lora_modules=modules, metrics_port=0, metrics_compat="vllm") as w:
        for job_id in ids:
            assert client.result(job_id, timeout=10).status == "completed"
        expected = {
            "a2": {"waiting": 0, "running": 0, "requests": 3, "tokens": 24},
            "a1": {"waiting": 0, "running": 0, "requests": 2, "tokens": 16},
            OTHER: {"waiting": 0, "running": 0, "requests": 1, "tokens": 8},
        }
        status = wait_for(
            lambda: (st := queue_status(r, "default"))["loras"] == expected and st, timeout=10, what="the heartbeat"
        )
        text = render([status])
        assert "LORA ADAPTER" in text and "(other)" in text
        assert w.metrics is not None
        samples = wait_for(
            lambda: (got := scrape(w.metrics.port)).get(("pagedq_lora_admitted_jobs", (("lora", OTHER),))) and got,
            timeout=10,
            what="the metrics",
        )
        for name, row in expected.items():
            assert samples[("pagedq_lora_admitted_jobs", (("lora", name),))] == row["requests"]
            assert samples[("pagedq_lora_generated_tokens", (("lora", name),))] == row["tokens"]
        assert not any(key[0].startswith("pagedq_lora") and ("lora", "a0") in key[1] for key in samples)
        info = [labels for (name, labels) in samples if name == "vllm:lora_requests_info"]
        assert info == [(("max_lora", "4"), ("running_lora_adapters", ""), ("waiting_lora_adapters", ""))]


def test_held_jobs_count_as_waiting_or_running(r, redis_url):
    from pagedq.worker.service.context import ServiceContext

    from .helpers import fast_settings

    adapters = WorkerLoras(ServiceContext.build(r, fast_settings()), StubEngine())
    job = build_job(prompt="x", lora="a")
    held = [HeldJob(JobKey("default", str(i)), job, seq=i) for i in range(3)]
    held[0].move(JobState.IN_ENGINE)
    adapters.counted("a", requests=1, tokens=5)
    assert adapters.figures(held).rows == {"a": {"waiting": 2, "running": 1, "requests": 1, "tokens": 5}}
    two = {f"a{i}": {"waiting": 0, "running": 0, "requests": 1, "tokens": 1} for i in range(2)}
    adapters.counted("a0", requests=1, tokens=1)
    adapters.counted("a1", requests=1, tokens=1)
    assert adapters.rows([], top=2) == {
        "a": {"waiting": 0, "running": 0, "requests": 1, "tokens": 5},
        "a0": two["a0"],
        OTHER: two["a1"],
    }


@pytest.mark.slow
def test_bad_lora_modules_are_one_line_at_start(redis_url, tmp_path):
    """Each start-up mistake of --lora-modules: exit 2, one line naming it, before the model loads (no traceback)."""
    from .test_startup_errors import assert_readable, run_cli

    malformed = run_cli(["worker", "--redis", redis_url, "--engine", "stub", "--lora-modules", "no-equals"], tmp_path)
    assert malformed.returncode == 2 and "Traceback" not in malformed.stderr
    assert "--lora-modules='no-equals'" in malformed.stderr  # the flag's own check, as every flag's
    cases = [
        (["--engine", "stub", "--lora-modules", "bad name=/x"], "LoRA adapter name"),
        (["--lora-modules", f"a={tmp_path}"], "--lora-modules needs --enable-lora"),  # the real engine: none loaded
        (["--engine", "stub", "--lora-modules", f"gone={tmp_path / 'nothing'}"], "LoRA adapter 'gone'"),
    ]
    for args, needle in cases:
        result = run_cli(["worker", "--redis", redis_url, "--burst", *args], tmp_path)
        assert_readable(result, "lora_modules", needle)
