"""A Phi-3 checkpoint with LongRoPE through the worker (its loop and Redis, the real engine): greedy jobs, prompts
within and past the original window, checked token for token against transformers."""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForCausalLM

from pagedq.engine import LLMEngine
from pagedq.worker import Client
from tests.conftest import build_tokenizer
from tests.engine.parity import assert_greedy_parity, hf_greedy
from tests.engine.test_rope_scalings import ORIGINAL_MAX, _config, _prompts

from .helpers import assert_clean_queue, worker_thread


def test_phi3_longrope_jobs_through_the_worker(redis_url, r, tmp_path):
    folder = tmp_path / "phi3"
    torch.manual_seed(0)
    transformers.Phi3ForCausalLM(_config("phi3-longrope")).save_pretrained(folder)
    build_tokenizer(folder)
    prompts = _prompts((9, 20, 40, 70), seed=6)
    new_tokens = [ORIGINAL_MAX - 9, ORIGINAL_MAX - 20, 16, 16]  # the short ones stay within the original window
    client = Client(redis_url)
    ids = client.submit_many(
        [
            dict(prompt_token_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True)
            for prompt, n in zip(prompts, new_tokens)
        ]
    )
    engine = LLMEngine(str(folder), device="cpu", block_size=16, num_kv_blocks=32)
    with worker_thread(engine, redis_url):
        results = [client.result(job_id, timeout=60) for job_id in ids]
    for result, prompt, n in zip(results, prompts, new_tokens):
        assert result.status == "completed", result
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        expected, logits = hf_greedy(hf, prompt, n)
        assert assert_greedy_parity(result.token_ids, expected, logits) == 0
    assert_clean_queue(r)
