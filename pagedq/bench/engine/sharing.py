"""`pagedq bench throughput --sharing n4|prefix|beam`: memory sharing on against the same engine with it off.

- n4: every prompt asks for 4 samples. On: one prefill, forked samples sharing the prompt's blocks. Off:
  4 independent requests with prefix caching off, each prefilling and storing the prompt itself.
- prefix: every prompt starts with the same long system prompt. On: prefix caching. Off: disabled.
Both runs see identical requests; the line reports throughput and peak KV blocks of each.
- beam: beam search (width 4) over the prompts. Beams cannot run unshared in this engine, so the line
  reports, at the step of peak use, the physical blocks against the block-table entries they serve (what
  the beams would hold without sharing), as the PagedAttention paper measures it.
"""

from __future__ import annotations

import random
import time

from pagedq.engine import LLMEngine, RequestOutputKind, SamplingParams
from pagedq.engine.startup import freeze_startup_objects


def _requests(
    kind: str,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab: int,
    prefix_len: int,
    seed: int,
    sharing: bool,
) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab - 10) for _ in range(prefix_len)] if kind == "prefix" else []
    requests = []
    for index in range(num_prompts):
        prompt = prefix + [rng.randrange(10, vocab - 10) for _ in range(rng.randint(*input_len))]
        max_tokens = rng.randint(*output_len)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed + index,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        if kind == "n4" and sharing:
            requests.append((prompt, SamplingParams(**{**params.__dict__, "n": 4, "best_of": 4})))
        elif kind == "n4":
            requests += [(prompt, SamplingParams(**{**params.__dict__, "seed": seed + index + i})) for i in range(4)]
        else:
            requests.append((prompt, params))
    return requests


def _run(model_dir: str, requests, engine_kwargs: dict, sharing: bool) -> dict:
    engine = LLMEngine(model_dir, **{**engine_kwargs, "enable_prefix_caching": sharing})
    freeze_startup_objects()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    start = time.perf_counter()
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            generated += sum(len(c.token_ids) for c in output.outputs)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return {
        "output_tok_s": generated / seconds,
        "generated": generated,
        "seconds": seconds,
        "peak_used_blocks": stats["peak_used_blocks"],
        "prefilled_tokens": stats["num_prefilled_tokens"],
        "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
        "preemptions": stats["num_preemptions"],
    }


def _run_beam(model_dir: str, vocab: int, args, engine_kwargs: dict) -> dict:
    from pagedq.engine.beam_search import BeamSearchParams

    rng = random.Random(args.seed)
    engine = LLMEngine(model_dir, **{**engine_kwargs, "enable_prefix_caching": False})
    freeze_startup_objects()
    num_prompts = args.num_prompts or 16
    for i in range(num_prompts):
        prompt = [rng.randrange(10, vocab - 10) for _ in range(rng.randint(*args.input_len))]
        params = BeamSearchParams(beam_width=4, max_tokens=rng.randint(*args.output_len), ignore_eos=True)
        engine.add_beam_search_request(f"b{i}", prompt, params)
    start, peak_used, peak_logical = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        used = engine.num_total_blocks - engine.num_free_blocks
        if used > peak_used:
            peak_used, peak_logical = used, used + engine.stats()["blocks_saved_by_sharing"]
    seconds = time.perf_counter() - start
    return {
        "bench": "sharing-beam",
        "date": time.strftime("%Y-%m-%d"),
        "num_prompts": num_prompts,
        "beam_width": 4,
        "seconds": seconds,
        "peak_used_blocks": peak_used,
        "peak_block_table_entries": peak_logical,
        "kv_memory_saved": 1 - peak_used / peak_logical,
    }


def run_sharing(kind: str, model_dir: str, vocab: int, args, engine_kwargs: dict) -> dict:
    if kind == "beam":
        return _run_beam(model_dir, vocab, args, engine_kwargs)
    num_prompts = args.num_prompts or 32
    draw = dict(
        kind=kind,
        num_prompts=num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        vocab=vocab,
        prefix_len=args.prefix_len,
        seed=args.seed,
    )
    on = _run(model_dir, _requests(**draw, sharing=True), engine_kwargs, sharing=True)
    off = _run(model_dir, _requests(**draw, sharing=False), engine_kwargs, sharing=False)
    return {
        "bench": f"sharing-{kind}",
        "date": time.strftime("%Y-%m-%d"),
        "num_prompts": num_prompts,
        "sharing_on": on,
        "sharing_off": off,
        "throughput_ratio": on["output_tok_s"] / off["output_tok_s"],
        "kv_memory_saved": 1 - on["peak_used_blocks"] / off["peak_used_blocks"],
    }
