"""gpt-oss (tiny random checkpoint: alternating sliding/full attention with sinks, experts with biases and the
clamped SwiGLU, YaRN) served by a real worker process: every job's greedy tokens equal transformers' eager generate,
prompts longer than the sliding window."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedq.worker import Client
from tests.conftest import random_tokens
from tests.engine.parity import assert_greedy_parity, hf_greedy

from .helpers import assert_clean_queue, finals_by_id, start_worker

MAX_TOKENS = 12


@pytest.mark.slow
def test_gpt_oss_jobs_through_the_worker_match_transformers(redis_url, r, checkpoint_factory, tmp_path):
    folder = checkpoint_factory("gpt_oss")
    prompts = [random_tokens(n, seed=200 + n) for n in (4, 19, 40)]
    jobs = [
        dict(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stream=i == 0)
        for i, prompt in enumerate(prompts)
    ]
    ids = Client(redis_url).submit_many(jobs)
    log = tmp_path / "w.log"
    proc = start_worker(redis_url, "--model", str(folder), "--device", "cpu", "--burst", "--name", "gptoss", log=log)
    assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    finals = finals_by_id(r)
    ties = 0
    for job_id, prompt in zip(ids, prompts):
        (record,) = finals[job_id]
        assert record["status"] == "completed" and record["finish_reason"] == "length", record
        expected, logits = hf_greedy(hf, prompt, MAX_TOKENS)
        ties += assert_greedy_parity(record["token_ids"], expected, logits)
    assert ties == 0
    assert_clean_queue(r)
