"""`pagedq bulk` edges against a real Redis and worker: the summary's keys, a last line without a newline,
the request's model echoed, line-level error rows with ids, and tok/s on resume counting only this run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from redis import Redis

from pagedq.worker.bulk.lines import job_id_for
from pagedq.worker.bulk.runner import BulkRun
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import KEYS, REPO, offline, run_burst, wait_for, worker_thread


def _openai(cid: str, prompt: str, max_tokens: int, model: str = "my-model") -> str:
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        }
    )


def _bulk(redis_url: str, *args: str, **kwargs) -> subprocess.CompletedProcess | subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedq.worker", "bulk", *args, "--redis", redis_url, "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if kwargs.pop("background", False):
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_summary_model_echo_error_ids_and_a_last_line_without_newline(redis_url, r, tmp_path):
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    lines = [
        _openai("a", "alpha", 3),
        "{broken",
        json.dumps({"prompt": "no id"}),
        json.dumps({"custom_id": "plain", "prompt": "beta", "max_tokens": 2, "temperature": 0}),
        _openai("z", "omega", 4, model="other-model"),
    ]
    inp.write_text("\n".join(lines))  # no trailing newline
    assert BulkRun(r, inp, out, err, progress=False).total_lines == len(lines)
    with worker_thread(StubEngine(), redis_url):
        proc = _bulk(redis_url, str(inp), str(out), "--errors", str(err))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["errors_file"] == str(err) and summary["output_file"] == str(out)
    assert summary["errors"] == 2 and summary["completed"] == 3  # counts, not paths
    results = {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert results["a"]["response"]["body"]["model"] == "my-model"
    assert results["z"]["response"]["body"]["model"] == "other-model"  # the last line, without its newline
    assert results["z"]["response"]["body"]["choices"][0]["text"] == offline("omega", max_tokens=4, temperature=0.0)[0]
    assert results["plain"]["response"]["body"]["model"] is None  # a plain line names no model
    errors = [json.loads(x) for x in err.read_text().splitlines()]
    assert sorted(e["line"] for e in errors) == [2, 3]
    assert [e["id"] for e in sorted(errors, key=lambda e: e["line"])] == ["batch_req_line_2", "batch_req_line_3"]


@pytest.mark.slow
def test_resume_counts_tok_s_only_for_jobs_that_finish_in_this_run(redis_url, r, tmp_path):
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    prompts = {f"c{i}": (f"prompt {i}", 3 + i) for i in range(6)}
    inp.write_text("".join(_openai(cid, p, n) + "\n" for cid, (p, n) in prompts.items()))
    first = _bulk(redis_url, str(inp), str(out), "--errors", str(err), "--window", "3", background=True)
    run_id = BulkRun(r, inp, out, err, progress=False).run_id
    wait_for(lambda: r.scard(KEYS.bulk_enqueued(run_id)) == 3, what="the first window enqueued (no worker yet)")
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=20) == 130
    run_burst(StubEngine(), redis_url)  # the three finish while no bulk run watches
    early = {job_id_for(run_id, cid) for cid in list(prompts)[:3]}
    assert all(Redis.from_url(redis_url).get(KEYS.final(j)) for j in early)
    with worker_thread(StubEngine(step_delay_s=0.002), redis_url):
        counts = BulkRun(Redis.from_url(redis_url), inp, out, err, window=3, progress=False).run()
    assert counts["completed"] == 6 and counts["awaited"] == 3 and counts["enqueued"] == 3
    tokens = {cid: len(offline(p, max_tokens=n, temperature=0.0)[1]) for cid, (p, n) in prompts.items()}
    assert counts["tokens"] == sum(tokens.values())
    assert counts["run_tokens"] == sum(tokens[cid] for cid in list(prompts)[3:])  # tok/s counts these only
