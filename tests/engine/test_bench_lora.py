"""`pagedq bench lora` at a tiny size: one JSON line, the engine's adapted outputs equal to transformers + PEFT's."""

from __future__ import annotations

import json
from pathlib import Path

from pagedq.bench.cli import main
from pagedq.bench.engine.lora import TARGETS, write_adapters
from pagedq.bench.engine.workload import draw_workload


def test_bench_lora_prints_one_json_line(tiny_llama_dir, capsys):
    argv = ["lora", "--model", str(tiny_llama_dir), "--num-prompts", "6", "--num-adapters", "3", "--rank", "2:4"]
    code = main([*argv, "--input-len", "4:12", "--output-len", "6:10", "--max-num-seqs", "8", "--rounds", "2"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["output_tokens"] == sum(draw_workload(6, (4, 12), (6, 10), 512).output_lens)
    assert result["base_output_tok_s"] > 0 and result["lora_output_tok_s"] > 0 and result["peft_output_tok_s"] > 0
    assert result["lora_vs_base"] > 0 and result["lora_vs_peft"] > 0 and len(result["lora_vs_base_rounds"]) == 2
    # every request ran under an adapter that changed its output, and equals PEFT's (near-ties apart)
    assert result["requests"] == 6 and result["requests_changed_by_adapter"] >= 4
    assert result["outputs_exact"] and result["exact_requests"] + result["near_ties"] == 6


def test_written_adapters_load_in_peft(tiny_llama_dir, tmp_path: Path):
    from peft import PeftConfig

    adapters = write_adapters(str(tiny_llama_dir), tmp_path, 2, (3, 5), seed=1)
    for number, adapter in enumerate(adapters):
        config = PeftConfig.from_pretrained(adapter.path)
        assert config.r == adapter.rank and 3 <= adapter.rank <= 5
        assert set(config.target_modules) == set(TARGETS) and config.use_rslora == (number == 1)
