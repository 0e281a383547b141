"""200 jobs through a real worker process on the tiny random-weight Llama, checked token for token against
LLM.generate with the same parameters (greedy and seeded sampling), streamed deltas against the final."""

from __future__ import annotations

import json

import pytest

from pagedq.engine import LLM, SamplingParams
from pagedq.worker import Client

from .helpers import KEYS, assert_clean_queue, finals_by_id, result_stream, start_worker

WORDS = ["fox", "cache", "block", "queue", "stream", "worker", "token", "batch", "paged", "Redis"]


def workload(n: int) -> list[dict]:
    jobs = []
    for i in range(n):
        prompt = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 9))
        job = dict(prompt=prompt, max_tokens=4 + i % 13, stream=i % 3 == 0, metadata={"i": i})
        if i % 4 == 3:
            job.update(temperature=0.8, top_p=0.9, top_k=50, seed=1000 + i)
        else:
            job.update(temperature=0.0)
        if i % 10 == 5:
            job.update(prompt_token_ids=[1, 17 + i, 42, 99], prompt=None)
        if i % 20 == 7:
            job.update(prompt_logprobs=2)  # scoring the prompt, as a bulk document pipeline would
        jobs.append(job)
    return jobs


@pytest.mark.slow
def test_200_jobs_match_llm_generate(redis_url, r, tiny_llama_dir, tmp_path):
    client = Client(redis_url)
    jobs = workload(200)
    ids = client.submit_many(jobs[:-1])
    raw = {"id": "raw-xadd", **{k: v for k, v in jobs[-1].items() if v is not None}}
    r.xadd(KEYS.jobs, {"job": json.dumps(raw)})  # the language-agnostic path
    ids.append("raw-xadd")
    proc = start_worker(
        redis_url,
        "--model",
        str(tiny_llama_dir),
        "--device",
        "cpu",
        "--burst",
        "--max-num-seqs",
        "64",
        "--name",
        "real",
        log=tmp_path / "w.log",
    )
    assert proc.wait(timeout=240) == 0, (tmp_path / "w.log").read_text()[-3000:]

    llm = LLM(str(tiny_llama_dir), device="cpu")
    params = [
        SamplingParams(**{k: v for k, v in j.items() if k not in ("prompt", "prompt_token_ids", "stream", "metadata")})
        for j in jobs
    ]
    oracle = llm.generate([j["prompt"] if j["prompt"] is not None else j["prompt_token_ids"] for j in jobs], params)
    events = [json.loads(line) for line in (tmp_path / "w.log").read_text().splitlines() if line.startswith("{")]
    problems = [e for e in events if e["level"] in ("warning", "error")]
    assert problems == [], problems[:5]  # no engine errors, reruns or lost leases on a healthy run
    finals = finals_by_id(r)
    assert len(finals) == 200 and all(len(v) == 1 for v in finals.values())
    for job_id, job, expected in zip(ids, jobs, oracle):
        record = finals[job_id][0]
        want = expected.outputs[0]
        assert record["status"] == "completed", record
        assert (record["token_ids"], record["text"], record["finish_reason"]) == (
            list(want.token_ids),
            want.text,
            want.finish_reason,
        ), job
        assert record["metadata"] == job["metadata"]
        _assert_same_prompt_logprobs(record["prompt_logprobs"], expected.prompt_logprobs)
        assert record["usage"] == {
            "prompt_tokens": len(expected.prompt_token_ids),
            "completion_tokens": len(want.token_ids),
        }
        if job["stream"]:
            deltas = [d for kind, d in result_stream(r, job_id) if kind == "delta"]
            assert "".join(d["text"] for d in deltas) == record["text"]
            assert [t for d in deltas for t in d["token_ids"]] == record["token_ids"]
            assert [d["pos"] for d in deltas] == sorted(d["pos"] for d in deltas)
            assert [d.text for d in client.stream(job_id, timeout=5)] == [d["text"] for d in deltas]
    assert_clean_queue(r)


def _assert_same_prompt_logprobs(got: list | None, expected: list | None) -> None:
    """The worker's record (JSON: string keys) against LLM.generate's (batch shapes may move fp32 sums slightly)."""
    if expected is None:
        assert got is None
        return
    assert len(got) == len(expected) and got[0] is None and expected[0] is None
    for entry, want in zip(got[1:], expected[1:]):
        assert set(entry) == {str(token) for token in want}
        assert all(abs(entry[str(token)] - logprob) < 1e-4 for token, logprob in want.items())


def test_cancelled_running_job_keeps_its_partial_output(redis_url, r, tiny_llama_dir):
    from pagedq.engine import LLMEngine

    from .helpers import wait_for, worker_thread

    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    client = Client(redis_url)
    job_id = client.submit(prompt="fox cache block", max_tokens=400, temperature=0.0, ignore_eos=True, stream=True)
    with worker_thread(engine, redis_url):
        wait_for(lambda: r.xlen(KEYS.result(job_id)) >= 3, what="3 deltas of the running job")
        assert client.cancel(job_id)
        final = client.result(job_id, timeout=30)
        wait_for(lambda: engine.num_free_blocks == 64, what="blocks freed")
    assert final.status == "cancelled" and final.finish_reason == "abort"
    assert 3 <= len(final.token_ids) < 400
    expected = LLM(str(tiny_llama_dir)).generate(
        "fox cache block", SamplingParams(max_tokens=len(final.token_ids), temperature=0.0, ignore_eos=True)
    )[0]
    assert final.token_ids == expected.outputs[0].token_ids and final.text == expected.outputs[0].text
