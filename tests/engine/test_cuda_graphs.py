"""Decode steps through the CUDA-graph runner's padded static buffers.

Without a GPU the runner does everything but capture and replay (capture=False runs the same padded
forward eagerly), so these tests check the bucketing, the padding rows and the buffer reuse across steps
against transformers' own greedy generate.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedq.engine import LLM, SamplingParams
from pagedq.engine.runner.cuda_graphs import DecodeGraphRunner, batch_buckets, bucket_for, width_buckets
from pagedq.engine.runner.model_runner import StepInputs
from tests.conftest import VOCAB_SIZE
from tests.engine.parity import assert_greedy_parity, hf_greedy


def test_buckets():
    assert batch_buckets(256)[:6] == [1, 2, 4, 8, 16, 32] and batch_buckets(256)[-1] == 256
    assert len(batch_buckets(256)) == 4 + 16
    assert batch_buckets(6) == [1, 2, 4, 6] and batch_buckets(1) == [1] and batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert width_buckets(256, 16) == [32, 128, 256] and width_buckets(8192, 16) == [32, 128, 512, 2048, 8192]
    assert width_buckets(100, 2) == [100] and width_buckets(600, 2) == [256, 600] and width_buckets(8, 16) == [8]
    assert [bucket_for(n, [1, 2, 4, 6]) for n in (1, 3, 5, 6)] == [1, 4, 6, 6]


def _padded_runner(llm: LLM, first_width_tokens: int = 512) -> DecodeGraphRunner:
    runner = llm.llm_engine.model_runner
    graphs = DecodeGraphRunner(
        runner.model,
        runner.kv_caches,
        runner.config.max_num_seqs,
        -(-runner.max_model_len // runner.block_size),
        runner.block_size,
        runner.device,
        capture=False,
        first_width_tokens=first_width_tokens,
    )
    runner.decode_graphs = graphs
    return graphs


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])  # qwen3_moe: padding rows through the experts
def test_padded_decode_matches_transformers(checkpoint_factory, arch):
    folder = checkpoint_factory(arch)
    rng = random.Random(4)
    # 5 sequences decode in a bucket of 6; as they finish (different lengths) the batch shrinks through the
    # buckets of 4, 2 and 1; at block size 2 the widest table (the 40-token prompt, 30 tokens out) moves from
    # the 32-block width bucket into the 128-block one.
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (3, 40, 17, 9, 25)]
    max_tokens = [12, 30, 5, 20, 8]
    llm = LLM(folder, max_num_seqs=6, block_size=2, num_kv_blocks=256)
    graphs = _padded_runner(llm, first_width_tokens=16)
    assert graphs.widths == [8, 32, 128, 256]
    outputs = llm.generate(
        prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    )
    assert graphs.num_runs >= max(max_tokens) - 1  # every step after the first prefill is decode-only
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ties = 0
    for prompt, n, output in zip(prompts, max_tokens, outputs):
        theirs, logits = hf_greedy(model, prompt, n)
        ties += assert_greedy_parity(output.outputs[0].token_ids, theirs, logits)
    assert ties == 0, f"{ties} near-ties where none were measured (see tests/engine/parity.py)"


def test_padded_step_equals_the_unpadded_one_and_padding_writes_nothing(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_num_seqs=4, num_kv_blocks=32, block_size=16)
    runner = llm.llm_engine.model_runner
    graphs = _padded_runner(llm)
    for k_cache, v_cache in runner.kv_caches:  # a cache full of finite history for the queries to attend to
        k_cache.normal_()
        v_cache.normal_()
    start = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    # 3 sequences pad to a bucket of 4 rows; tables of width 2 pad to the 32-block width bucket.
    tables = np.array([[3, 7], [5, 0], [9, 2]], dtype=np.int32)
    context_lens = np.array([20, 4, 30], dtype=np.int32)
    positions = context_lens.astype(np.int64) - 1
    slot_mapping = tables[np.arange(3), positions // 16].astype(np.int64) * 16 + positions % 16
    step = StepInputs(
        token_ids=np.array([11, 12, 13]),
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=tables,
        context_lens=context_lens,
        lengths=np.ones(3, dtype=np.int64),
        num_decode=3,
    )
    padded = runner._forward(step)
    padded_caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    assert graphs.num_runs == 1
    for (k, v), (k0, v0) in zip(runner.kv_caches, start):  # back to the start, then the plain eager step
        k.copy_(k0)
        v.copy_(v0)
    runner.decode_graphs = None
    eager = runner._forward(step)
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    for (k, v), (pk, pv), (k0, _) in zip(runner.kv_caches, padded_caches, start):
        # CPU GEMMs may round rows differently for 3 and 4 rows: the written values agree to fp32 tolerance;
        # which slots were written is checked exactly below.
        torch.testing.assert_close(pk, k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pv, v, rtol=1e-5, atol=1e-5)
        assert sorted(((pk != k0).flatten(2).any(dim=2).flatten().nonzero().flatten()).tolist()) == sorted(
            slot_mapping.tolist()
        )
        slots_changed = (k != k0).flatten(2).any(dim=2).flatten().nonzero().flatten()  # slot = block * 16 + offset
        assert sorted(slots_changed.tolist()) == sorted(slot_mapping.tolist())


def test_capture_inputs_are_padding_only_and_write_nothing(tiny_llama_dir):
    """What capture_all runs before each capture (the warm-up) must leave the cache untouched."""
    llm = LLM(tiny_llama_dir, max_num_seqs=4, num_kv_blocks=32, block_size=16)
    runner = llm.llm_engine.model_runner
    graphs = _padded_runner(llm)
    for k_cache, v_cache in runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    start = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for batch in graphs.batch_sizes:
        graphs.fill_padding(batch)
        hidden = graphs._forward(batch, graphs.widths[-1])
        assert hidden.shape[0] == batch and torch.isfinite(hidden).all()
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(runner.kv_caches, start))
