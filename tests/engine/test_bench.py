"""`pagedq bench throughput`: the workload draw matches shared/anchors, and the command prints its JSON line."""

from __future__ import annotations

import json
import random

import pytest

from engine.bench.throughput import WORKLOADS, draw_workload
from engine.cli import main


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
            "bench",
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
            "3",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected_tokens = sum(draw_workload(6, (8, 40), (4, 12), 512).output_lens)
    assert result["engine_generated_tokens"] == result["output_tokens"] == expected_tokens
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
            "bench",
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
