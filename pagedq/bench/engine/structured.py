"""`pagedq bench structured`: what structured outputs cost, one JSON line.

    compile_ms      cold (an empty cache) and cached, for three real schemas: flat, nested with arrays, enum-heavy
    mask_fill       host time per bitmask row over matchers spread through a document: one thread's CPU time, and
                    xgrammar's batch fill on 1 and 2 threads; mask_fill_wide: the same at --wide-vocab-size
    e2e             output tokens/s on the model with all, half and none of the requests structured (one run)

The tokenizer and the end-to-end model are the demo model's (SmolLM2-135M-Instruct) unless --model is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

FLAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "date": {"type": "string", "format": "date"},
        "total": {"type": "number"},
        "paid": {"type": "boolean"},
    },
    "required": ["name", "date", "total", "paid"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "invoice": {"type": "string"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string", "format": "email"}},
            "required": ["name"],
        },
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["sku", "qty", "price"],
            },
        },
    },
    "required": ["invoice", "customer", "lines"],
}
COUNTRIES = [f"country_{i:03d}" for i in range(200)]
ENUMS = {
    "type": "object",
    "properties": {
        "country": {"enum": COUNTRIES},
        "currency": {"enum": [f"C{i:02d}" for i in range(60)]},
        "category": {"enum": [f"category-{i}" for i in range(100)]},
        "status": {"enum": ["open", "closed", "pending", "void"]},
    },
    "required": ["country", "currency", "category", "status"],
}
# The same with maxLength on two strings: in xgrammar 0.2.8 every row filled inside a bounded string costs far more
BOUNDED = json.loads(json.dumps(NESTED))
BOUNDED["properties"]["invoice"]["maxLength"] = 16
BOUNDED["properties"]["lines"]["items"]["properties"]["sku"]["maxLength"] = 16
SCHEMAS: dict[str, dict[str, Any]] = {"flat": FLAT, "nested_arrays": NESTED, "enum_heavy": ENUMS}
# A document of the nested schema whose prefixes put the mask-fill matchers in different states.
DOCUMENT = json.dumps(
    {
        "invoice": "INV-2024-0042",
        "customer": {"name": "Acme Tools", "email": "billing@acme.example"},
        "lines": [
            {"sku": "HAMMER-01", "qty": 3, "price": 12.5, "tags": ["tools", "steel"]},
            {"sku": "NAILS-500", "qty": 10, "price": 4.25, "tags": []},
        ],
    }
)


def compile_times(tokenizer, vocab_size: int, repeats: int) -> dict[str, dict[str, float]]:
    from pagedq.engine.structured_output.compiler import GrammarCompilerPool
    from pagedq.engine.structured_output.params import StructuredOutputsParams

    out = {}
    for name, schema in SCHEMAS.items():
        params = StructuredOutputsParams(json=schema)
        cold, cached = [], []
        for _ in range(repeats):
            pool = GrammarCompilerPool(tokenizer, vocab_size, cache_bytes=256 << 20)
            start = time.perf_counter()
            pool.compile(params)
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            pool.compile(params)
            cached.append(time.perf_counter() - start)
            pool.close()
        out[name] = {"cold_ms": 1e3 * statistics.median(cold), "cached_ms": 1e3 * statistics.median(cached)}
    return out


def mask_fill_us_per_row(tokenizer, vocab_size: int, rows: int, repeats: int, schema: dict | None = None) -> dict:
    """Per bitmask row, over `rows` matchers spread through DOCUMENT: the CPU time of one thread filling them one
    by one (thread_time: what the row costs, whatever else runs), and the wall time of xgrammar's
    BatchGrammarMatcher on 1 and 2 threads (medians of `repeats`)."""
    from pagedq.engine.structured_output.backend import xgrammar
    from pagedq.engine.structured_output.compiler import GrammarCompilerPool
    from pagedq.engine.structured_output.matcher import SequenceGrammar
    from pagedq.engine.structured_output.params import StructuredOutputsParams

    xgr = xgrammar()
    pool = GrammarCompilerPool(tokenizer, vocab_size, cache_bytes=256 << 20)
    compiled = pool.compile(StructuredOutputsParams(json=schema or NESTED))
    document = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    sequences = []
    for row in range(rows):
        state = SequenceGrammar(compiled, [], vocab_size)
        if state.feed(document[: row * len(document) // rows]) is not None:
            raise RuntimeError("the benchmark document does not match its schema")
        sequences.append(state)
    bitmask = xgr.allocate_token_bitmask(rows, vocab_size)
    cpu: list[float] = []
    batch: dict[int, list[float]] = {threads: [] for threads in (1, 2)}
    for _ in range(repeats):
        start = time.thread_time()
        for row, state in enumerate(sequences):
            state.fill_row(bitmask, row)
        cpu.append(time.thread_time() - start)
        for threads, times in batch.items():
            matcher = xgr.BatchGrammarMatcher(max_threads=threads)
            start = time.perf_counter()
            matcher.batch_fill_next_token_bitmask([s.matcher for s in sequences], bitmask)
            times.append(time.perf_counter() - start)
    pool.close()
    return {
        "cpu_us_per_row": 1e6 * statistics.median(cpu) / rows,
        **{f"batch_{n}_threads_wall_us_per_row": 1e6 * statistics.median(t) / rows for n, t in batch.items()},
    }


def wide_vocab_mask_fill(vocab_size: int, rows: int, repeats: int) -> dict:
    """The mask fill at `pagedq bench host --sampling json`'s vocabulary (SmolLM2's widened with word-piece
    merges), for the invoice schema as it is and with maxLength on two of its strings (xgrammar #852)."""
    from transformers import AutoTokenizer

    from pagedq.bench.engine.structured_host import model_folder

    tokenizer = AutoTokenizer.from_pretrained(model_folder(vocab_size))
    return {
        "vocab_size": vocab_size,
        "nested_arrays": mask_fill_us_per_row(tokenizer, vocab_size, rows, repeats),
        "nested_arrays_maxlength_16": mask_fill_us_per_row(tokenizer, vocab_size, rows, repeats, BOUNDED),
    }


def end_to_end(model: str | None, num_prompts: int, output_len: int) -> dict[str, dict[str, float]]:
    from pagedq.engine import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(model, max_num_seqs=num_prompts)
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write invoice number {i} for Acme Tools as JSON, with two lines."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(num_prompts)
    ]
    constraint = StructuredOutputsParams(json=NESTED)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, structured_outputs=constraint))  # warm-up + compile
    results = {}
    for label, fraction in (("all", 1.0), ("half", 0.5), ("none", 0.0)):
        params = [
            SamplingParams(
                max_tokens=output_len,
                temperature=0.0,
                structured_outputs=constraint if i < round(fraction * num_prompts) else None,
            )
            for i in range(num_prompts)
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        results[label] = {"output_tokens": tokens, "wall_s": wall, "output_tok_per_s": tokens / wall}
    return results


def run(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoTokenizer

    from pagedq.engine.config.engine import ModelConfig
    from pagedq.engine.demo_model import demo_model_path

    model = args.model or str(demo_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab_size = ModelConfig.from_pretrained(model).vocab_size
    import importlib.metadata

    return {
        "bench": "structured",
        "model": model,
        "vocab_size": vocab_size,
        "xgrammar": importlib.metadata.version("xgrammar"),
        "torch": torch.__version__,
        "compile": compile_times(tokenizer, vocab_size, args.repeats),
        "mask_fill_rows": args.rows,
        "mask_fill": mask_fill_us_per_row(tokenizer, vocab_size, args.rows, args.repeats),
        "mask_fill_wide": wide_vocab_mask_fill(args.wide_vocab_size, args.rows, args.repeats)
        if args.wide_vocab_size
        else None,
        "e2e": end_to_end(model, args.num_prompts, args.output_len) if args.num_prompts else None,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the demo model)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each timing; the median is reported")
    parser.add_argument("--rows", type=int, default=64, help="matchers whose mask rows are filled (default 64)")
    parser.add_argument(
        "--wide-vocab-size",
        type=int,
        default=128256,
        help="also time the mask fill at this vocabulary (bench host --sampling json's tokenizer; 0: skip)",
    )
    parser.add_argument("--num-prompts", type=int, default=16, help="end-to-end requests per run (0: skip)")
    parser.add_argument("--output-len", type=int, default=48, help="end-to-end max_tokens (default 48)")


def main(args: argparse.Namespace) -> int:
    for name in ("repeats", "rows"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_prompts < 0 or args.output_len < 1:
        raise ValueError("--num-prompts must be >= 0 and --output-len >= 1")
    print(json.dumps(run(args)))
    return 0
