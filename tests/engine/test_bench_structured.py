"""`pagedq bench structured` runs through on a tiny checkpoint: every schema compiles (cold and cached), the mask
rows fill from matchers spread through a valid document, and the end-to-end runs generate (figures:
docs/benchmarks.md#structured-outputs)."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedq.bench.engine import structured


def test_bench_structured_runs_and_reports_every_figure(tiny_llama_dir, capsys):
    args = argparse.Namespace(
        model=str(tiny_llama_dir), repeats=1, rows=4, num_prompts=0, output_len=8, wide_vocab_size=50_000
    )
    assert structured.main(args) == 0
    line = json.loads(capsys.readouterr().out)
    assert set(line["compile"]) == {"flat", "nested_arrays", "enum_heavy"}
    assert all(v["cold_ms"] > 0 and v["cached_ms"] > 0 for v in line["compile"].values())
    assert line["mask_fill"]["cpu_us_per_row"] > 0 and line["e2e"] is None
    wide = line["mask_fill_wide"]
    assert wide["vocab_size"] == 50_000 and all(v > 0 for v in wide["nested_arrays_maxlength_16"].values())


def test_the_mask_fill_document_matches_its_schema():
    import jsonschema

    jsonschema.validate(json.loads(structured.DOCUMENT), structured.NESTED)
    jsonschema.validate(json.loads(structured.DOCUMENT), structured.BOUNDED)


@pytest.mark.slow  # the demo model's tokenizer
def test_bench_host_json_keeps_async_and_sync_identical_with_every_row_masked():
    from pagedq.bench.engine import structured_host

    args = argparse.Namespace(
        num_seqs=4,
        output_len=6,
        prompt_len=16,
        simulated_device_ms=1.0,
        seed=0,
        structured_fraction=0.5,
        vocab_size=50_000,
        device="cpu",
    )
    line = structured_host.run(args)  # raises if async and sync differ, or a masked draw is refused
    assert line["tokens_identical"] and line["sync_mask_wait_ms_per_step"] >= 0
    assert 0 < line["async_device_busy_fraction"] <= 1
    # the same run's control: no row structured, so no mask is filled or waited for
    assert 0 < line["unconstrained_async_device_busy_fraction"] <= 1
    assert line["unconstrained_async_mask_fill_ms_per_step"] == 0 == line["unconstrained_async_mask_wait_ms_per_step"]
