"""`pagedq bulk` on 500 lines against a worker thread (stub engine, with a chat template): killed with -9
midway, then resumed. Oracles: the stub engine's own answer for each line, the errors we put in the input,
and the worker's counters (no job ran twice)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from pagedq.worker.bulk.lines import job_id_for
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import KEYS, REPO, assert_clean_queue, finals_by_id, offline, wait_for, worker_thread

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def make_input(path) -> tuple[dict[str, tuple[str, int]], dict[str, str]]:
    """500 lines; returns {custom_id: (engine prompt, max_tokens)} of the good ones and the expected errors
    ({custom_id or "line:N": error code})."""
    good, errors, lines = {}, {}, []
    for i in range(480):
        cid, max_tokens = f"req-{i}", 3 + i % 6
        if i % 3 == 0:  # OpenAI batch, chat
            messages = [{"role": "user", "content": f"question {i}"}]
            lines.append(
                {
                    "custom_id": cid,
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": "any", "messages": messages, "max_tokens": max_tokens, "temperature": 0},
                }
            )
            good[cid] = (f"<user>question {i}</user><assistant>", max_tokens)
        elif i % 3 == 1:  # OpenAI batch, completions
            lines.append(
                {
                    "custom_id": cid,
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {
                        "model": "any",
                        "prompt": f"text {i}",
                        "max_completion_tokens": max_tokens,
                        "temperature": 0,
                        "stop": None,
                    },
                }
            )
            good[cid] = (f"text {i}", max_tokens)
        else:  # plain
            lines.append({"custom_id": cid, "prompt": f"plain {i}", "max_tokens": max_tokens, "temperature": 0.0})
            good[cid] = (f"plain {i}", max_tokens)
    text = [json.dumps(line) for line in lines]
    bad = [
        ("{not json", "invalid_json"),
        (json.dumps({"prompt": "no id"}), "missing_custom_id"),
        (json.dumps({"custom_id": "req-7", "prompt": "again"}), "duplicate_custom_id"),
        (json.dumps({"custom_id": "bad-field", "prompt": "x", "response_format": {"type": "text"}}), "invalid_request"),
        (json.dumps({"custom_id": "bad-value", "prompt": "x", "temperature": -2}), "invalid_request"),
        (json.dumps({"custom_id": "too-long", "prompt": "y" * 3000}), "rejected"),
    ]  # the engine's verdict
    for k in range(20):  # spread the bad lines through the file
        raw, code = bad[k % len(bad)]
        if k >= len(bad):
            raw, code = json.dumps({"custom_id": f"extra-bad-{k}", "prompt": ""}), "invalid_request"
        pos = 25 * k + 3
        text.insert(pos, raw)
    for n, raw in enumerate(text, 1):
        code = dict(bad).get(raw) or ("invalid_request" if "extra-bad" in raw else None)
        if code:
            cid = None if code in ("invalid_json", "missing_custom_id") else json.loads(raw)["custom_id"]
            errors[f"line:{n}" if cid is None or code == "duplicate_custom_id" else cid] = code
    path.write_text("\n".join(text) + "\n")
    assert len(text) == 500
    return good, errors


def bulk_cmd(redis_url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pagedq.worker", "bulk", *args, "--redis", redis_url, "--window", "16"]


@pytest.mark.slow
def test_bulk_500_lines_killed_midway_and_resumed(redis_url, r, tmp_path):
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    good, expected_errors = make_input(inp)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    engine = StubEngine(step_delay_s=0.01, chat_template=TEMPLATE, max_model_len=1024)
    with worker_thread(engine, redis_url, max_waiting=16) as worker:
        cmd = bulk_cmd(redis_url, str(inp), str(out), "--errors", str(err))
        first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: out.exists() and out.read_text().count("\n") >= 120, timeout=60, what="120 results")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        assert out.read_text().count("\n") < len(good), "the kill should come midway"
        second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stderr[-2000:]
        summary = json.loads(second.stdout.strip().splitlines()[-1])
        assert summary["skipped"] >= 100 and summary["enqueued"] > 0
        assert summary["awaited"] > 0  # in flight at the kill: awaited, not enqueued again
        assert "job/s" in second.stderr or "%" in second.stderr  # the progress bar
    results = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [res["custom_id"] for res in results]
    assert sorted(ids) == sorted(good), "each good custom_id exactly once in the output"
    for res in results:
        prompt, max_tokens = good[res["custom_id"]]
        body = res["response"]["body"]
        choice = body["choices"][0]
        text = choice["message"]["content"] if body["object"] == "chat.completion" else choice["text"]
        assert text == offline(prompt, max_tokens=max_tokens, temperature=0.0)[0], res["custom_id"]
        assert res["error"] is None and res["response"]["status_code"] == 200
        assert body["usage"]["completion_tokens"] == max_tokens
        assert (body["object"] == "chat.completion") == (int(res["custom_id"].split("-")[1]) % 3 == 0)
    errors = [json.loads(line) for line in err.read_text().splitlines()]
    got = {
        (
            f"line:{e['line']}"
            if e["custom_id"] is None or e["error"]["code"] == "duplicate_custom_id"
            else e["custom_id"]
        ): e["error"]["code"]
        for e in errors
    }
    assert len(errors) == len(got) == len(expected_errors)  # each error exactly once, across the restart
    assert got == expected_errors
    too_long = next(e for e in errors if e["custom_id"] == "too-long")
    assert (
        "maximum context length" in too_long["error"]["message"]
        and too_long["response"]["body"]["status"] == "rejected"
    )
    # nothing was enqueued twice: one job per valid line, each run once by the worker
    enqueued = len(good) + 1  # + "too-long", which the engine rejected
    assert r.scard(KEYS.bulk_enqueued(summary["run_id"])) == enqueued
    assert worker.stats["completed"] == len(good) and worker.stats["rejected"] == 1
    assert worker.publisher.duplicates == 0
    finals = finals_by_id(r)
    assert set(finals) == {job_id_for(summary["run_id"], cid) for cid in [*good, "too-long"]}
    assert_clean_queue(r)
    # a third run finds everything answered and enqueues nothing
    third = subprocess.run(
        bulk_cmd(redis_url, str(inp), str(out), "--errors", str(err), "--no-progress"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    summary3 = json.loads(third.stdout.strip().splitlines()[-1])
    assert summary3["enqueued"] == summary3["awaited"] == summary3["errors"] == 0
    answered_in_errors = [key for key in expected_errors if not key.startswith("line:")]
    assert summary3["skipped"] == len(good) + len(answered_in_errors)
