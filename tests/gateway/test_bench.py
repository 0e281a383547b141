"""`pagedq bench gateway` runs end to end (stub worker + gateway subprocesses) and reports every figure.
Speed itself is not asserted here (that is the benchmark's job, on a quiet machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO


@pytest.mark.slow
def test_bench_gateway_reports_native_and_gateway_figures():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedq.worker",
            "bench",
            "gateway",
            "--requests",
            "60",
            "--concurrency",
            "4",
            "--latency-requests",
            "9",
            "--stream-requests",
            "3",
            "--stream-tokens",
            "5",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["native_requests_per_s"] > 0 and result["gateway_requests_per_s"] > 0
    for side in ("native", "gateway"):
        assert result[f"{side}_latency"]["p50_ms"] > 0
        assert result[f"{side}_stream"]["chunks_per_request"] == 5  # one chunk per token of the stub engine
        assert result[f"{side}_stream"]["first_chunk"]["p50_ms"] > 0
    assert "added_latency_p50_ms" in result and "added_latency_p99_ms" in result
