"""`pagedq bench throughput`: the workload draw matches shared/anchors, and the command prints its JSON line."""

from __future__ import annotations

import json
import random

from engine.bench import WORKLOADS, draw_workload
from engine.cli import main


def test_workload_draw_is_the_anchor_workload():
    # shared/anchors/hf_anchor.py draws, per request: prompt length, its tokens, then the output length.
    vocab = WORKLOADS["W1"]["shape"]["vocab_size"]
    rng = random.Random(0)
    expected = [([rng.randrange(10, vocab - 10) for _ in range(rng.randint(128, 1024))], rng.randint(64, 512))
                for _ in range(5)]
    workload = draw_workload(5, (128, 1024), (64, 512), vocab, seed=0)
    assert list(zip(workload.prompts, workload.output_lens)) == expected


def test_bench_throughput_prints_one_json_line(tiny_llama_dir, capsys):
    code = main(["bench", "throughput", "--model", str(tiny_llama_dir), "--num-prompts", "6", "--input-len", "8:40",
                 "--output-len", "4:12", "--baseline", "hf", "--hf-batch-size", "3"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected_tokens = sum(draw_workload(6, (8, 40), (4, 12), 512).output_lens)
    assert result["engine_generated_tokens"] == result["output_tokens"] == expected_tokens
    for key in ("engine_output_tok_s", "hf_output_tok_s", "ratio", "kv_slot_utilization", "peak_memory_gb",
                "num_preemptions"):
        assert key in result
    assert 0 < result["kv_slot_utilization"] <= 1
