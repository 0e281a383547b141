"""`pagedq bench gateway`: the gateway's cost on the stub engine (pagedq/worker/testing/stub_engine.py), in one run.

A worker (stub engine) and one `pagedq serve` process run as subprocesses over an embedded Redis; this
process drives them. The same jobs go through the native AsyncClient (submit + result / stream) and through
the gateway (the OpenAI HTTP API, httpx): requests/s at a concurrency, p50/p99 latency one request at a time
(the gateway's added latency is the difference), and for streaming the first-chunk latency and chunks/s.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from pagedq.bench.worker.gateway_args import add_args  # noqa: F401  (the command's flags)
from pagedq.worker.client.async_client import AsyncClient
from pagedq.worker.ops.embedded_redis import EmbeddedRedis, free_port

# The folder that holds the `pagedq` package (a checkout or site-packages): the spawned processes import it from
# there even when it is not installed.
IMPORT_ROOT = Path(__file__).resolve().parents[3]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(_percentile(values, 0.5) * 1000, 3), "p99_ms": round(_percentile(values, 0.99) * 1000, 3)}


async def _throughput(call: Callable[[int, int], Awaitable[object]], n: int, concurrency: int) -> float:
    counter = iter(range(n))

    async def lane(lane_no: int) -> None:
        for i in counter:
            await call(i, lane_no)

    start = time.perf_counter()
    await asyncio.gather(*[lane(k) for k in range(concurrency)])
    return round(n / (time.perf_counter() - start), 1)


async def _latencies(call: Callable[..., Awaitable[object]], n: int) -> list[float]:
    out = []
    for i in range(n):
        start = time.perf_counter()
        await call(i)
        out.append(time.perf_counter() - start)
    return out


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc): what a request costs, whatever else the machine runs."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(redis_url: str, base: str, args: argparse.Namespace, gateway_pid: int) -> dict:
    native = AsyncClient(redis_url)
    # one single-connection client per lane: httpx's shared pool slows down sharply with many connections
    https = [httpx.AsyncClient(base_url=base, timeout=60) for _ in range(args.concurrency)]
    http = https[0]
    body = {"model": "stub", "max_tokens": 1, "temperature": 0}

    async def via_native(i: int, lane: int = 0) -> None:
        record = await native.result(await native.submit(prompt=f"job {i}", max_tokens=1, temperature=0.0), 60)
        assert record.ok, record.error

    async def via_gateway(i: int, lane: int = 0) -> None:
        response = await https[lane].post("/completions", json={**body, "prompt": f"job {i}"})
        assert response.status_code == 200, response.text

    async def stream_native(i: int) -> tuple[float, int]:
        start = time.perf_counter()
        job_id = await native.submit(
            prompt=f"s {i}", max_tokens=args.stream_tokens, temperature=0.0, stream=True, ignore_eos=True
        )
        first: float | None = None
        chunks = 0
        async for _ in native.stream(job_id, timeout=60):
            first = first or time.perf_counter() - start
            chunks += 1
        return _first_chunk(first), chunks

    async def stream_gateway(i: int) -> tuple[float, int]:
        start = time.perf_counter()
        first: float | None = None
        chunks = 0
        payload = {**body, "prompt": f"s {i}", "max_tokens": args.stream_tokens, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/completions", json=payload) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"text":""' not in line:
                    first = first or time.perf_counter() - start
                    chunks += 1
        return _first_chunk(first), chunks

    warm = min(8, args.concurrency)  # warm-up: connections, scripts, code paths
    await _throughput(via_native, 200, warm)
    await _throughput(via_gateway, 200, warm)
    result: dict = {}
    for name, call in (("native", via_native), ("gateway", via_gateway)):
        cpu_before = cpu_seconds(gateway_pid)
        result[f"{name}_requests_per_s"] = await _throughput(call, args.requests, args.concurrency)
        cpu_after = cpu_seconds(gateway_pid)
        if name == "gateway" and cpu_before is not None and cpu_after is not None:
            # the gateway process's own CPU per request: 1000 / this = requests/s one free core would carry
            result["gateway_cpu_ms_per_request"] = round((cpu_after - cpu_before) * 1000 / args.requests, 3)
    lat: dict[str, list[float]] = {"native": [], "gateway": []}
    for _ in range(3):  # interleaved blocks: drift on a shared machine hits both alike
        for name, call in (("native", via_native), ("gateway", via_gateway)):
            lat[name] += await _latencies(call, args.latency_requests // 3)
    result["native_latency"], result["gateway_latency"] = _ms(lat["native"]), _ms(lat["gateway"])
    result["added_latency_p50_ms"] = round(result["gateway_latency"]["p50_ms"] - result["native_latency"]["p50_ms"], 3)
    result["added_latency_p99_ms"] = round(result["gateway_latency"]["p99_ms"] - result["native_latency"]["p99_ms"], 3)
    for name, stream_call in (("native", stream_native), ("gateway", stream_gateway)):
        start = time.perf_counter()
        runs = [await stream_call(i) for i in range(args.stream_requests)]
        elapsed = time.perf_counter() - start
        result[f"{name}_stream"] = {
            "first_chunk": _ms([r[0] for r in runs]),
            "chunks_per_s": round(sum(r[1] for r in runs) / elapsed, 1),
            "chunks_per_request": round(statistics.mean(r[1] for r in runs), 1),
        }
    for client in https:
        await client.aclose()
    await native.aclose()
    return result


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(IMPORT_ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "pagedq.worker", *cmd], env=env, stdout=fh, stderr=fh)


def run(args: argparse.Namespace) -> int:
    redis = EmbeddedRedis(extra_args=("--save", "", "--appendonly", "no")).start()
    logs = Path(tempfile.mkdtemp(prefix="pagedq-bench-gateway-"))
    port = free_port()
    procs = [
        _spawn(
            [
                "worker",
                "--engine",
                "stub",
                "--redis",
                redis.url,
                "--max-waiting",
                "1024",
                "--max-num-seqs",
                "512",
                "--num-kv-blocks",
                "1048576",
                "--log-level",
                "error",
            ],
            logs / "bench-worker.log",
        ),
        _spawn(
            ["serve", "--redis", redis.url, "--port", str(port), "--log-level", "error"], logs / "bench-gateway.log"
        ),
    ]
    try:
        base = f"http://127.0.0.1:{port}/v1"
        _wait_ready(base)
        result = asyncio.run(_drive(redis.url, base, args, procs[1].pid))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        redis.stop()
    result.update(
        date=datetime.date.today().isoformat(),
        python=platform.python_version(),
        cpus=os.cpu_count(),
        requests=args.requests,
        concurrency=args.concurrency,
    )
    result["logs"] = str(logs)
    print(json.dumps(result))
    return 0


def _wait_ready(base: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(base + "/models", timeout=1).json().get("data"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise RuntimeError("the gateway or the stub worker did not come up")


def _first_chunk(seconds: float | None) -> float:
    """Time to a stream's first chunk; a stream that sent none is a failed run, not a number."""
    if seconds is None:
        raise RuntimeError("a benchmark stream ended without a single chunk")
    return seconds
