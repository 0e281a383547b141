"""A Gemma 2 checkpoint (sliding and global layers, both soft-caps) through a real worker process: greedy jobs
(prompts longer than the sliding window, one streamed, one scoring its prompt) against transformers' own greedy
continuation and log-probabilities. One family is enough here: tests/engine/test_gemma.py covers both in the engine."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedq.worker import Client
from tests.conftest import VOCAB_SIZE
from tests.engine.parity import assert_greedy_parity, hf_greedy

from .helpers import assert_clean_queue, finals_by_id, result_stream, start_worker

NEW_TOKENS = 12


@pytest.mark.slow
def test_gemma2_jobs_through_the_worker_match_transformers(redis_url, r, checkpoint_factory, tmp_path):
    folder = checkpoint_factory("gemma2")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (6, 19, 30, 41)]  # the window is 8
    client = Client(redis_url)
    jobs = [
        dict(prompt_token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, stream=i == 1)
        | ({"prompt_logprobs": 2} if i == 2 else {})
        for i, prompt in enumerate(prompts)
    ]
    ids = client.submit_many(jobs)
    proc = start_worker(
        redis_url, "--model", str(folder), "--device", "cpu", "--burst", "--name", "gemma", log=tmp_path / "w.log"
    )
    assert proc.wait(timeout=240) == 0, (tmp_path / "w.log").read_text()[-3000:]

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    finals = finals_by_id(r)
    ties = 0
    for job_id, job, prompt in zip(ids, jobs, prompts):
        (record,) = finals[job_id]
        assert record["status"] == "completed" and record["finish_reason"] == "length", record
        expected, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        ties += assert_greedy_parity(record["token_ids"], expected, logits)
        if job["stream"]:
            deltas = [d for kind, d in result_stream(r, job_id) if kind == "delta"]
            assert [t for d in deltas for t in d["token_ids"]] == record["token_ids"]
        if "prompt_logprobs" in job:
            with torch.no_grad():
                reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
            entries = record["prompt_logprobs"]
            assert len(entries) == len(prompt) and entries[0] is None
            for j, entry in enumerate(entries[1:], start=1):
                assert set(entry) == {str(t) for t in reference[j - 1].topk(2).indices.tolist()} | {str(prompt[j])}
                assert all(abs(lp - reference[j - 1, int(t)].item()) < 1e-4 for t, lp in entry.items())
        else:
            assert record["prompt_logprobs"] is None
    assert ties == 0, f"{ties} near-ties where none were measured (see tests/engine/parity.py)"
    assert_clean_queue(r)
