"""`pagedq bench worker`: (a) the queue layer against the stub engine, (b) the real engine through Redis
against LLM.generate on the same workload, in the same run. Prints one JSON line."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time
from typing import Any

from pagedq.worker.assembly import Worker
from pagedq.worker.client.sync_client import Client
from pagedq.worker.ops.embedded_redis import EmbeddedRedis
from pagedq.worker.protocol.connection import connect
from pagedq.worker.protocol.job import FinalRecord
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.testing.stub_engine import StubEngine


def _enqueue(client: Client, jobs: list[dict]) -> None:
    for i in range(0, len(jobs), 1000):
        client.submit_many(jobs[i : i + 1000])


def _run_burst(engine: Any, url: str, queue: str, max_waiting: int) -> float:
    return _burst_worker(engine, url, queue, max_waiting)[0]


def _burst_worker(engine: Any, url: str, queue: str, max_waiting: int) -> tuple[float, Worker]:
    settings = WorkerSettings(
        queue=queue, name=f"bench-{queue}", burst=True, max_waiting=max_waiting, heartbeat_every_s=60.0
    )
    worker = Worker(engine, connect(url), settings)
    start = time.perf_counter()
    worker.run()
    return time.perf_counter() - start, worker


def _finals(client: Client, ids: list[str]) -> list[FinalRecord]:
    pipe = client.r.pipeline(transaction=False)
    for job_id in ids:
        pipe.get(client.keys.final(job_id))
    return [FinalRecord.model_validate_json(raw) for raw in pipe.execute()]


def bench_queue(url: str, n: int, stream: bool) -> dict:
    """Jobs/s admitted and published by one worker process whose engine costs nothing."""
    queue = "benchstream" if stream else "benchq"
    client = Client(url, queue=queue)
    jobs = [
        {"prompt": f"job {i}", "max_tokens": 4 if stream else 1, "temperature": 0.0, "stream": stream} for i in range(n)
    ]
    _enqueue(client, jobs)
    engine = StubEngine(max_num_seqs=512, num_kv_blocks=1 << 20)
    elapsed = _run_burst(engine, url, queue, max_waiting=1024)
    done = client.r.xlen(client.keys.completions)  # one final record per job, all "completed" here
    return {"jobs": done, "seconds": round(elapsed, 3), "jobs_per_s": round(done / elapsed, 1)}


GREEDY = {"temperature": 0.0, "ignore_eos": True}


def e2e_prompts(n: int, lengths: str, vocab_size: int) -> list[str] | list[list[int]]:
    """Text prompts, or (lengths "LOW:HIGH") token-id prompts of LOW to HIGH tokens drawn with a fixed seed."""
    if not lengths:
        return [f"Request {i}: write a short note about queues and caches number {i}." for i in range(n)]
    low, sep, high = lengths.partition(":")
    if not sep or not low.isdigit() or not high.isdigit() or not 1 <= int(low) <= int(high):
        raise ValueError(f"--e2e-prompt-tokens {lengths!r}: expected LOW:HIGH with 1 <= LOW <= HIGH")
    rng = random.Random(23)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(int(low), int(high)))] for _ in range(n)]


def _prompt_field(prompt: str | list[int]) -> dict[str, Any]:
    return {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}


def bench_e2e(url: str, args: argparse.Namespace) -> dict:
    """Output tokens/s of the real engine fed through Redis vs LLM.generate on the same engine and prompts.
    Alternates the two `repeats` times and compares the best of each (shared machines are noisy)."""
    from pagedq.engine import LLM, SamplingParams
    from pagedq.engine.options import engine_kwargs_from
    from pagedq.engine.startup import freeze_startup_objects

    model = args.model
    if model is None:
        from pagedq.engine.demo_model import demo_model_path

        model = str(demo_model_path())
    llm = LLM(model, **engine_kwargs_from(args))
    freeze_startup_objects()  # as the worker does, so both sides run with the same GC state
    n, max_tokens = args.e2e_jobs, args.e2e_max_tokens
    prompts = e2e_prompts(n, getattr(args, "e2e_prompt_tokens", ""), llm.llm_engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], params)  # warm-up (allocations, kernels)
    offline_runs, worker_runs, identical = [], [], n  # identical: the fewest token-identical jobs of any run
    step_ms: dict[str, list[float]] = {"offline": [], "worker": []}  # wall time per engine step, each run
    busy: dict[str, list[float]] = {"offline": [], "worker": []}  # the device thread's busy fraction, each run
    parts: list[dict[str, float]] = []  # the worker's turn parts per engine step, each run
    engine = llm.llm_engine
    device = engine.model_runner.device_queue
    client = Client(url, queue="benche2e")
    for _ in range(max(1, getattr(args, "e2e_repeats", 1))):
        steps, was_busy, start = engine.num_steps, device.busy_seconds, time.perf_counter()
        offline = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        offline_runs.append(sum(len(o.outputs[0].token_ids) for o in offline) / seconds)
        step_ms["offline"].append(1e3 * seconds / max(engine.num_steps - steps, 1))
        busy["offline"].append((device.busy_seconds - was_busy) / seconds)
        ids = client.submit_many([{**_prompt_field(p), "max_tokens": max_tokens, **GREEDY} for p in prompts])
        steps, was_busy = engine.num_steps, device.busy_seconds
        seconds, worker = _burst_worker(engine, url, "benche2e", max_waiting=max(args.max_num_seqs, n))
        step_ms["worker"].append(1e3 * seconds / max(engine.num_steps - steps, 1))
        busy["worker"].append((device.busy_seconds - was_busy) / seconds)
        parts.append(worker.turn_clock.per_step_ms(engine.num_steps - steps))
        finals = _finals(client, ids)
        worker_runs.append(sum(len(r.token_ids) for r in finals if r.ok) / seconds)
        identical = min(identical, sum(r.token_ids == list(o.outputs[0].token_ids) for r, o in zip(finals, offline)))
    return {
        "model": os.path.basename(str(model).rstrip("/")),
        "device": args.device,
        "jobs": n,
        "prompts": getattr(args, "e2e_prompt_tokens", "") or "text",
        "max_tokens": max_tokens,
        "offline_tokens_per_s": round(max(offline_runs), 1),
        "worker_tokens_per_s": round(max(worker_runs), 1),
        "worker_vs_offline": round(max(worker_runs) / max(offline_runs), 3),
        "runs": {"offline": [round(x, 1) for x in offline_runs], "worker": [round(x, 1) for x in worker_runs]},
        "ratio_per_run": [round(w / o, 3) for w, o in zip(worker_runs, offline_runs)],
        # the device thread's busy time over the run's wall time: what the loop costs the engine shows as a drop
        "device_busy_fraction": {side: [round(x, 3) for x in values] for side, values in busy.items()},
        "worker_turn_ms_per_step": parts,  # where the worker's turns went, per engine step (service/turn_clock.py)
        "token_identical_jobs": identical,
        # the loop's own cost: wall time per engine step through the worker less in-process (best run of each)
        "step_ms": {side: round(min(values), 2) for side, values in step_ms.items()},
        "loop_ms_per_step": round(min(step_ms["worker"]) - min(step_ms["offline"]), 2),
    }


def run_bench(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {
        "bench": "worker",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "python": platform.python_version(),
    }
    with EmbeddedRedis() as redis_server:
        if getattr(args, "mixed", False):
            from pagedq.bench.worker.mixed import bench_mixed

            result["mixed"] = bench_mixed(redis_server.url, args)
            print(json.dumps(result), flush=True)
            return 0
        result["queue"] = bench_queue(redis_server.url, args.stub_jobs, stream=False)
        result["queue_streamed_4_tokens"] = bench_queue(redis_server.url, max(args.stub_jobs // 4, 1), stream=True)
        if args.e2e_jobs > 0:
            result["e2e"] = bench_e2e(redis_server.url, args)
    print(json.dumps(result), flush=True)
    if "e2e" in result and result["e2e"]["token_identical_jobs"] != result["e2e"]["jobs"]:
        print("bench worker: the worker's outputs differ from LLM.generate's", file=sys.stderr)
        return 1
    return 0
