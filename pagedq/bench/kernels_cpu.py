"""`pagedq bench kernels --device cpu`: the CPU attention path (kernels.cpu_attention) next to what it is measured
against in the same run: torch's SDPA over the same K/V already contiguous (the cost of attention alone, with no
gather: the target the paged path is held to; called both with enable_gqa and with each KV head's query heads
folded into query rows, as the paged path does, and the faster of the two is the target) and the reference
(kernels.reference, the oracle). Decode reports both of its paths: the native kernel reading the blocks in place
(kernels.cpu_native; `native_ms`, null where it is unavailable) and the index_select + SDPA fallback
(`gather_sdpa_ms`); `ms` is the path kernels.cpu_attention takes here (`native_path` says which). Then one
decoder layer's LoRA calls at decode and at prefill (bench.kernels_lora.bench_cpu_lora).

Timings are medians over --repeats calls, after one warm-up call. The K/V pool is one layer's; each sequence's
blocks are scattered over it as a busy server leaves them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from pagedq.bench.kernels_lora import bench_cpu_lora
from pagedq.kernels import cpu_attention, cpu_native, reference
from pagedq.kernels.cpu_allocator import tune_cpu_allocator


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _scattered_cache(num_seqs: int, context_len: int, num_kv_heads: int, head_dim: int, block_size: int, dtype):
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    tables = torch.randperm(num_blocks).to(torch.int32).view(num_seqs, blocks_per_seq)
    return k_cache, v_cache, tables, torch.full((num_seqs,), context_len, dtype=torch.int32)


def bench_cpu_decode(args: argparse.Namespace, context_len: int, report: Callable[..., None]) -> None:
    num_q_heads, num_kv_heads = args.heads
    dtype = getattr(torch, args.dtype)
    k_cache, v_cache, tables, lens = _scattered_cache(
        args.batch, context_len, num_kv_heads, args.head_dim, args.block_size, dtype
    )
    query = torch.randn(args.batch, num_q_heads, args.head_dim).to(dtype)
    scale = args.head_dim**-0.5
    paged_args = (query, k_cache, v_cache, tables, lens, scale)
    shape = f"S={args.batch} ctx={context_len} Hq={num_q_heads} Hkv={num_kv_heads} D={args.head_dim} {args.dtype}"
    paged_ms = _median_ms(lambda: cpu_attention.paged_decode_attention(*paged_args), args.repeats)
    sdpa = _contiguous_sdpa_ms(args, query, k_cache, v_cache, tables, context_len)
    gather_plan = cpu_attention.plan_decode(tables, lens, args.block_size, native=False)
    gather_ms = _median_ms(
        lambda: cpu_attention.planned_decode(query, k_cache, v_cache, gather_plan, scale), args.repeats
    )
    native_ms = None
    if cpu_native.available() and cpu_native.supports(query, k_cache, v_cache):
        native_ms = _median_ms(lambda: cpu_native.paged_decode_attention(*paged_args), args.repeats)
    reference_ms = _median_ms(lambda: reference.paged_decode_attention(*paged_args), args.repeats)
    fast, oracle = cpu_attention.paged_decode_attention(*paged_args), reference.paged_decode_attention(*paged_args)
    diff = (fast.float() - oracle.float()).abs().max()
    report(
        "cpu paged_decode_attention",
        shape,
        paged_ms,
        sdpa_contiguous_ms=sdpa["sdpa_contiguous_ms"],
        sdpa_contiguous_gqa_ms=sdpa["gqa"],
        sdpa_contiguous_folded_ms=sdpa["folded"],
        over_sdpa=paged_ms / sdpa["sdpa_contiguous_ms"],
        reference_ms=reference_ms,
        speedup_over_reference=reference_ms / paged_ms,
        max_abs_diff_vs_reference=float(diff),
        native_path=cpu_attention.use_native(k_cache),
        native_ms=native_ms,
        native_over_sdpa=None if native_ms is None else native_ms / sdpa["sdpa_contiguous_ms"],
        gather_sdpa_ms=gather_ms,
        gather_sdpa_over_sdpa=gather_ms / sdpa["sdpa_contiguous_ms"],
    )


def _contiguous_sdpa_ms(
    args: argparse.Namespace,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    context_len: int,
) -> dict[str, float]:
    """SDPA over the same K/V already contiguous ([S, Hkv, ctx, D]), called with enable_gqa and with the query
    heads folded as the paged path folds them; the faster of the two is the target (sdpa_contiguous_ms)."""
    num_q_heads, num_kv_heads = args.heads
    scale = args.head_dim**-0.5

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        gathered = [reference.gather_kv(cache, tables[s], context_len) for s in range(args.batch)]
        return torch.stack(gathered).transpose(1, 2).contiguous()

    keys, values = contiguous(k_cache), contiguous(v_cache)
    gqa_ms = _median_ms(
        lambda: F.scaled_dot_product_attention(query[:, :, None], keys, values, scale=scale, enable_gqa=True),
        args.repeats,
    )
    folded = query.view(args.batch, num_kv_heads, num_q_heads // num_kv_heads, args.head_dim)  # as the paged path
    folded_ms = _median_ms(lambda: F.scaled_dot_product_attention(folded, keys, values, scale=scale), args.repeats)
    return {"gqa": gqa_ms, "folded": folded_ms, "sdpa_contiguous_ms": min(gqa_ms, folded_ms)}


def bench_cpu_prefill(args: argparse.Namespace, report: Callable[..., None]) -> None:
    """A step's worth of fresh prompts (the lengths of --prefill-lens), against the reference."""
    num_q_heads, num_kv_heads = args.heads
    dtype = getattr(torch, args.dtype)
    q_lens = args.prefill_lens
    k_cache, v_cache, tables, _ = _scattered_cache(
        len(q_lens), max(q_lens), num_kv_heads, args.head_dim, args.block_size, dtype
    )
    lens = torch.tensor(q_lens, dtype=torch.int32)
    cu_seqlens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_q_heads, args.head_dim).to(dtype)
    call_args = (query, k_cache, v_cache, tables, cu_seqlens, lens, args.head_dim**-0.5)
    paged_ms = _median_ms(lambda: cpu_attention.paged_prefill_attention(*call_args), args.repeats)
    reference_ms = _median_ms(lambda: reference.paged_prefill_attention(*call_args), args.repeats)
    shape = f"S={len(q_lens)} q={q_lens[0]}.. Hq={num_q_heads} Hkv={num_kv_heads} D={args.head_dim} {args.dtype}"
    report("cpu paged_prefill_attention", shape, paged_ms, reference_ms=reference_ms,
           speedup_over_reference=reference_ms / paged_ms)  # fmt: skip


def main_cpu(args: argparse.Namespace, report: Callable[..., None]) -> int:
    torch.manual_seed(0)
    tuned = tune_cpu_allocator()  # as the engine's entry points do: measure the path as it serves
    print(
        f"device: cpu, {torch.get_num_threads()} intra-op threads, allocator tuned: {tuned}; "
        f"timings are medians of {args.repeats}"
    )
    for context_len in args.context_lens:
        bench_cpu_decode(args, context_len, report)
    bench_cpu_prefill(args, report)
    bench_cpu_lora(args, _median_ms, report)
    return 0
