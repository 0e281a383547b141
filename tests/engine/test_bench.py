"""`pagedq bench throughput`: the workload draw matches shared/anchors, and the command prints its JSON line."""

from __future__ import annotations

import json
import random

import pytest

from pagedq.bench.cli import main
from pagedq.bench.engine.throughput import WORKLOADS, draw_workload


def test_workload_draw_is_the_anchor_workload():
    # shared/anchors/hf_anchor.py draws, per request: prompt length, its tokens, then the output length.
    vocab = WORKLOADS["W1"]["shape"]["vocab_size"]
    rng = random.Random(0)
    expected = [
        ([rng.randrange(10, vocab - 10) for _ in range(rng.randint(128, 1024))], rng.randint(64, 512)) for _ in range(5)
    ]
    workload = draw_workload(5, (128, 1024), (64, 512), vocab, seed=0)
    assert list(zip(workload.prompts, workload.output_lens)) == expected


def test_bench_throughput_prints_one_json_line(tiny_llama_dir, capsys):
    code = main(
        [
            "throughput",
            "--model",
            str(tiny_llama_dir),
            "--num-prompts",
            "6",
            "--input-len",
            "8:40",
            "--output-len",
            "4:12",
            "--baseline",
            "hf",
            "--hf-batch-size",
            "3,6",
            "--scheduling",
            "both",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected_tokens = sum(draw_workload(6, (8, 40), (4, 12), 512).output_lens)
    assert result["engine_generated_tokens"] == result["output_tokens"] == expected_tokens
    # one hf run per batch size, each with its ratio; the top level is against the fastest
    assert [run["hf_batch_size"] for run in result["hf_runs"]] == [3, 6]
    best = max(result["hf_runs"], key=lambda run: run["hf_output_tok_s"])
    assert result["hf_output_tok_s"] == best["hf_output_tok_s"] and result["ratio"] == best["ratio"]
    assert result["engine_async_output_tok_s"] > 0 and result["engine_sync_output_tok_s"] > 0
    # the decode step of the 6 requests, part by part, and the matmuls' time on its shapes
    assert result["step_batch"] == 6
    parts = ("step_attention_ms", "step_linear_ms", "step_lm_head_ms", "step_other_ms")
    assert all(result[part] >= 0 for part in parts) and result["roofline_ms_per_step"] > 0
    assert result["step_over_roofline"] == result["step_ms"] / result["roofline_ms_per_step"]
    for key in (
        "engine_output_tok_s",
        "hf_output_tok_s",
        "ratio",
        "kv_slot_utilization",
        "peak_memory_gb",
        "num_preemptions",
    ):
        assert key in result
    assert 0 < result["kv_slot_utilization"] <= 1


@pytest.mark.parametrize("kind", ["n4", "prefix", "beam"])
def test_sharing_bench_lines_report_memory_saved(tiny_llama_dir, capsys, kind):
    code = main(
        [
            "throughput",
            "--model",
            str(tiny_llama_dir),
            "--sharing",
            kind,
            "--num-prompts",
            "3",
            "--input-len",
            "40:60",
            "--output-len",
            "4:8",
            "--prefix-len",
            "48",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == f"sharing-{kind}"
    assert 0 < result["kv_memory_saved"] < 1
    if kind != "beam":  # same requests, same tokens generated, with and without sharing
        assert result["sharing_on"]["generated"] == result["sharing_off"]["generated"]
        assert result["sharing_on"]["peak_used_blocks"] < result["sharing_off"]["peak_used_blocks"]


def test_moe_workloads_are_qwen3_moe_shapes_and_the_bench_runs_a_moe_checkpoint(checkpoint_factory, capsys):
    from pagedq.bench.engine.args import MOE_WORKLOADS
    from pagedq.bench.engine.throughput import _workload_folder
    from pagedq.engine.config.engine import ModelConfig

    for name, (experts, top_k) in {"MOE-S": (8, 2), "MOE-M": (32, 4)}.items():
        config = ModelConfig.from_pretrained(_workload_folder(name))
        assert config.architecture == "Qwen3MoeForCausalLM" and config.moe is not None
        assert (config.moe.num_experts, config.moe.num_experts_per_tok) == (experts, top_k)
        assert config.hidden_size == MOE_WORKLOADS[name]["shape"]["hidden_size"]
    args = ["throughput", "--model", str(checkpoint_factory("qwen3_moe")), "--num-prompts", "4", "--input-len", "8:24"]
    assert main([*args, "--output-len", "4:8", "--baseline", "hf", "--hf-batch-size", "4", "--max-num-seqs", "4"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        result["engine_generated_tokens"]
        == result["output_tokens"]
        == sum(draw_workload(4, (8, 24), (4, 8), 512).output_lens)
    )
    assert result["hf_batch_size"] == 4 and result["ratio"] > 0
    assert result["step_parts_skipped"] == "not split for mixture-of-experts layers yet"


def test_the_gpt_oss_workload_is_a_gpt_oss_shape_and_the_bench_runs_gpt_oss(checkpoint_factory, capsys):
    from pagedq.bench.engine.throughput import _workload_folder
    from pagedq.engine.config.engine import ModelConfig

    config = ModelConfig.from_pretrained(_workload_folder("GPTOSS-M"))
    assert config.architecture == "GptOssForCausalLM" and config.attention_sinks and config.sliding_window == 128
    assert config.moe is not None and (config.moe.num_experts, config.moe.num_experts_per_tok) == (32, 4)
    assert config.hf_config.rope_parameters["rope_type"] == "yarn"
    args = ["throughput", "--model", str(checkpoint_factory("gpt_oss")), "--num-prompts", "4", "--input-len", "8:24"]
    assert main([*args, "--output-len", "4:8", "--baseline", "hf", "--hf-batch-size", "4", "--max-num-seqs", "4"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["engine_generated_tokens"] == result["output_tokens"] and result["ratio"] > 0
