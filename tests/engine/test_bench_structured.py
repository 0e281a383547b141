"""`pagedq bench structured` runs through on a tiny checkpoint: every schema compiles (cold and cached), the mask
rows fill from matchers spread through a valid document, and the end-to-end runs generate (figures: README)."""

from __future__ import annotations

import argparse
import json

from engine.bench import structured


def test_bench_structured_runs_and_reports_every_figure(tiny_llama_dir, capsys):
    args = argparse.Namespace(model=str(tiny_llama_dir), repeats=1, rows=4, num_prompts=0, output_len=8)
    assert structured.main(args) == 0
    line = json.loads(capsys.readouterr().out)
    assert set(line["compile"]) == {"flat", "nested_arrays", "enum_heavy"}
    assert all(v["cold_ms"] > 0 and v["cached_ms"] > 0 for v in line["compile"].values())
    assert line["mask_fill_us_per_row"] > 0 and line["e2e"] is None


def test_the_mask_fill_document_matches_its_schema():
    import jsonschema

    jsonschema.validate(json.loads(structured.DOCUMENT), structured.NESTED)
