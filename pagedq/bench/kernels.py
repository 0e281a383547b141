"""Kernel benchmark: `python -m pagedq.bench.kernels` or `pagedq bench kernels` (--device cuda exits 2 without a GPU;
--device cpu, the default without one, measures the CPU attention path: pagedq/bench/kernels_cpu.py).

Each kernel is timed with triton.testing.do_bench (median) and reported next to what the device can do,
measured in the same run:
  - memory-bound kernels: achieved bandwidth = compulsory bytes read + written / time, next to the bandwidth
    of a large device-to-device tensor copy timed the same way;
  - prefill attention: achieved TFLOP/s (causal: only the visible query/key pairs count) next to a dense
    bf16 matmul;
  - paged decode: also torch's scaled_dot_product_attention on the same K/V gathered contiguous.
Compulsory bytes are the inputs read once and the outputs written once; the decode split's fp32 partials
and re-reads through the cache are overheads the kernel pays, so they are not counted in its favour.
Every measurement also prints one JSON line (prefix "JSON ") for scripts.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Sequence

import torch

from pagedq.bench.kernels_lora import lora_bench_cases

# ----------------------------------------------------------------------------------------------------------------
# Byte and FLOP accounting (pure functions; unit-tested on CPU).


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def decode_attention_bytes(
    context_lens: Sequence[int], num_q_heads: int, num_kv_heads: int, head_dim: int, elem_bytes: int,
    block_size: int,
) -> int:  # fmt: skip
    """K and V of every context token once, the query in and the output out, block-table rows and lengths."""
    kv = 2 * sum(context_lens) * num_kv_heads * head_dim * elem_bytes
    query_and_out = 2 * len(context_lens) * num_q_heads * head_dim * elem_bytes
    tables = sum(_ceil_div(n, block_size) for n in context_lens) * 4 + len(context_lens) * 4
    return kv + query_and_out + tables


def causal_pairs(q_lens: Sequence[int], context_lens: Sequence[int]) -> int:
    """Visible (query, key) pairs: query i of a chunk of q_len at the end of context_len sees c - q_len + i + 1."""
    total = 0
    for q_len, context_len in zip(q_lens, context_lens):
        prefix = context_len - q_len
        total += q_len * prefix + q_len * (q_len + 1) // 2
    return total


def prefill_attention_flops(q_lens: Sequence[int], context_lens: Sequence[int], num_q_heads: int, head_dim: int) -> int:
    """Two matmuls (QK^T and PV), each 2 * head_dim FLOPs per visible pair and query head."""
    return 4 * head_dim * num_q_heads * causal_pairs(q_lens, context_lens)


def matmul_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def copy_bytes(numel: int, elem_bytes: int) -> int:
    """A copy reads and writes every element once."""
    return 2 * numel * elem_bytes


def store_kv_cache_bytes(num_tokens: int, num_kv_heads: int, head_dim: int, in_bytes: int, cache_bytes: int,
                         slot_bytes: int = 8) -> int:  # fmt: skip
    """Read key and value, write both into the cache, read the slot mapping."""
    return 2 * num_tokens * num_kv_heads * head_dim * (in_bytes + cache_bytes) + num_tokens * slot_bytes


def rms_norm_bytes(num_tokens: int, hidden: int, elem_bytes: int, weight_bytes: int, out_bytes: int,
                   with_residual: bool) -> int:  # fmt: skip
    """Read x (+ residual) and weight, write normed (+ the new residual)."""
    row = hidden * (elem_bytes + out_bytes)
    if with_residual:
        row += hidden * 2 * elem_bytes
    return num_tokens * row + hidden * weight_bytes


def head_rms_norm_bytes(num_tokens: int, num_heads: int, head_dim: int, elem_bytes: int, weight_bytes: int,
                        out_bytes: int) -> int:  # fmt: skip
    return num_tokens * num_heads * head_dim * (elem_bytes + out_bytes) + head_dim * weight_bytes


def rotary_bytes(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, elem_bytes: int,
                 cos_sin_bytes: int = 4, position_bytes: int = 8) -> int:  # fmt: skip
    """Read and write q and k, read one cos/sin row and one position per token."""
    qk = 2 * num_tokens * (num_q_heads + num_kv_heads) * head_dim * elem_bytes
    return qk + num_tokens * (head_dim * cos_sin_bytes + position_bytes)


def silu_and_mul_bytes(num_tokens: int, intermediate: int, elem_bytes: int) -> int:
    """Read gate and up, write the product."""
    return num_tokens * intermediate * 3 * elem_bytes


def copy_blocks_bytes(num_pairs: int, num_caches: int, block_numel: int, elem_bytes: int,
                      mapping_bytes: int = 16) -> int:  # fmt: skip
    """Read every source block and write every destination block in each cache, read the (src, dst) rows."""
    return 2 * num_pairs * num_caches * block_numel * elem_bytes + num_pairs * mapping_bytes


def gumbel_argmax_bytes(num_rows: int, vocab_size: int) -> int:
    """Read the fp32 logits, temperature (4), seed (8) and position (8) per row, write one int64 id per row."""
    return num_rows * (vocab_size * 4 + 4 + 8 + 8 + 8)


# ----------------------------------------------------------------------------------------------------------------
# Measurement helpers (CUDA only).


def _time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _report(kernel: str, shape: str, ms: float, **metrics) -> None:
    extras = "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    print(f"{kernel:<26} {shape:<44} {ms * 1e3:9.1f} us  {extras}")
    print("JSON " + json.dumps({"kernel": kernel, "shape": shape, "ms": round(ms, 5), **metrics}))


def _bandwidth_metrics(num_bytes: int, ms: float, copy_gbps: float) -> dict:
    gbps = num_bytes / (ms * 1e-3) / 1e9
    return {"GB/s": gbps, "copy_GB/s": copy_gbps, "pct_of_copy": 100.0 * gbps / copy_gbps}


def measure_copy_bandwidth(device: torch.device) -> float:
    """GB/s of a 1 GiB device-to-device copy, the practical memory roofline of this GPU."""
    src = torch.empty(256 * 2**20, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    gbps = copy_bytes(src.numel(), 4) / (ms * 1e-3) / 1e9
    _report("torch copy (roofline)", "1 GiB fp32", ms, **{"GB/s": gbps})
    return gbps


def measure_matmul_tflops(device: torch.device) -> float:
    size = 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    ms = _time_ms(lambda: a @ b)
    tflops = matmul_flops(size, size, size) / (ms * 1e-3) / 1e12
    _report("torch bf16 matmul (peak)", f"{size}x{size}x{size}", ms, **{"TFLOP/s": tflops})
    return tflops


# ----------------------------------------------------------------------------------------------------------------
# Kernel benchmarks.

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def _paged_cache(context_lens: Sequence[int], device: torch.device):
    """bf16 K/V caches with each sequence's blocks scattered over a shuffled pool, as in a busy server."""
    blocks_per_seq = [_ceil_div(n, BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(blocks_per_seq)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device=device)
    v_cache = torch.randn(shape, dtype=DTYPE, device=device)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    start = 0
    for seq, used in enumerate(blocks_per_seq):
        tables[seq, :used] = pool[start : start + used]
        start += used
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables, lens


def bench_decode(device, batch: int, context_len: int, copy_gbps: float) -> None:
    from pagedq.kernels import reference, triton_ops

    context_lens = [context_len] * batch
    k_cache, v_cache, tables, lens = _paged_cache(context_lens, device)
    query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    scale = HEAD_DIM**-0.5
    num_bytes = decode_attention_bytes(context_lens, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 2, BLOCK_SIZE)
    shape = f"S={batch} ctx={context_len} Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM}"
    out = triton_ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    ms = _time_ms(lambda: triton_ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale))
    _report("paged_decode_attention", shape, ms, **_bandwidth_metrics(num_bytes, ms, copy_gbps))

    # SDPA on the same K/V gathered contiguous [S, Hkv, ctx, D] (the gather itself is not timed).
    keys = torch.stack([reference.gather_kv(k_cache, tables[s], context_len) for s in range(batch)]).transpose(1, 2)
    values = torch.stack([reference.gather_kv(v_cache, tables[s], context_len) for s in range(batch)]).transpose(1, 2)
    keys, values, q4 = keys.contiguous(), values.contiguous(), query[:, :, None, :]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run_sdpa():
        return sdpa(q4, keys, values, scale=scale, enable_gqa=True)

    diff = (run_sdpa()[:, :, 0].float() - out.float()).abs().max().item()
    sdpa_ms = _time_ms(run_sdpa)
    metrics = _bandwidth_metrics(num_bytes, sdpa_ms, copy_gbps)
    _report("sdpa (contiguous K/V)", shape, sdpa_ms, **metrics, paged_speedup=sdpa_ms / ms, max_abs_diff=diff)


def bench_prefill(device, q_lens: Sequence[int], prefixes: Sequence[int], matmul_tflops: float) -> None:
    from pagedq.kernels import triton_ops

    context_lens = [p + q for p, q in zip(prefixes, q_lens)]
    k_cache, v_cache, tables, lens = _paged_cache(context_lens, device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    query = torch.randn(sum(q_lens), NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    scale = HEAD_DIM**-0.5
    ms = _time_ms(lambda: triton_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, lens, scale))
    tflops = prefill_attention_flops(q_lens, context_lens, NUM_Q_HEADS, HEAD_DIM) / (ms * 1e-3) / 1e12
    shape = f"S={len(q_lens)} q={q_lens[0]} prefix={prefixes[0]} Hq={NUM_Q_HEADS} D={HEAD_DIM}"
    metrics = {"TFLOP/s": tflops, "matmul_TFLOP/s": matmul_tflops, "pct_of_matmul": 100.0 * tflops / matmul_tflops}
    _report("paged_prefill_attention", shape, ms, **metrics)


def bench_elementwise(device, copy_gbps: float, tokens: int = 8192, hidden: int = 4096, intermediate: int = 14336):
    from pagedq.kernels import triton_ops

    slots = tokens
    k_cache, v_cache, _, _ = _paged_cache([slots], device)
    key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    value = torch.randn_like(key)
    slot_mapping = torch.randperm(slots, device=device)[:tokens]
    x = torch.randn(tokens, hidden, dtype=DTYPE, device=device)
    residual, weight = torch.randn_like(x), torch.randn(hidden, dtype=DTYPE, device=device)
    q = torch.randn(tokens, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    cos_sin = torch.randn(4096, HEAD_DIM, device=device)
    head_weight = torch.randn(HEAD_DIM, dtype=DTYPE, device=device)
    gate_up = torch.randn(tokens, 2 * intermediate, dtype=DTYPE, device=device)
    cases = [
        ("store_kv_cache", f"T={tokens} Hkv={NUM_KV_HEADS} D={HEAD_DIM}",
         lambda: triton_ops.store_kv_cache(key, value, k_cache, v_cache, slot_mapping),
         store_kv_cache_bytes(tokens, NUM_KV_HEADS, HEAD_DIM, 2, 2)),
        ("rms_norm (+residual)", f"T={tokens} H={hidden}",
         lambda: triton_ops.rms_norm(x, weight, 1e-6, residual), rms_norm_bytes(tokens, hidden, 2, 2, 2, True)),
        ("head_rms_norm", f"T={tokens} Hh={NUM_Q_HEADS} D={HEAD_DIM}",
         lambda: triton_ops.head_rms_norm(q, head_weight, 1e-6),
         head_rms_norm_bytes(tokens, NUM_Q_HEADS, HEAD_DIM, 2, 2, 2)),
        ("rotary_embedding", f"T={tokens} Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM}",
         lambda: triton_ops.rotary_embedding(q, key, positions, cos_sin),
         rotary_bytes(tokens, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 2)),
        ("silu_and_mul", f"T={tokens} I={intermediate}",
         lambda: triton_ops.silu_and_mul(gate_up), silu_and_mul_bytes(tokens, intermediate, 2)),
    ]  # fmt: skip
    for name, shape, fn, num_bytes in cases:
        ms = _time_ms(fn)
        _report(name, shape, ms, **_bandwidth_metrics(num_bytes, ms, copy_gbps))


def bench_copy_and_sampling(device, copy_gbps: float, num_layers: int = 32, num_pairs: int = 256,
                            vocab_size: int = 151936, sample_rows: Sequence[int] = (8, 256)) -> None:  # fmt: skip
    """copy_blocks (copy-on-write of num_pairs blocks in every layer) and gumbel_argmax (next to the torch
    sampler's temperature + noise + argmax on the same logits)."""
    from pagedq.kernels import reference, triton_ops

    num_blocks = 2 * num_pairs
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    keys = [torch.randn(shape, dtype=DTYPE, device=device) for _ in range(num_layers)]
    values = [torch.randn(shape, dtype=DTYPE, device=device) for _ in range(num_layers)]
    blocks = torch.randperm(num_blocks, device=device)
    mapping = torch.stack([blocks[:num_pairs], blocks[num_pairs:]], dim=1)
    # a partial, not a closure over keys/values: the `del` below must free the caches before the sampling runs
    ms = _time_ms(functools.partial(triton_ops.copy_blocks, keys, values, mapping))
    num_bytes = copy_blocks_bytes(num_pairs, 2 * num_layers, keys[0][0].numel(), keys[0].element_size())
    shape_text = f"L={num_layers} pairs={num_pairs} bs={BLOCK_SIZE} Hkv={NUM_KV_HEADS} D={HEAD_DIM}"
    _report("copy_blocks", shape_text, ms, **_bandwidth_metrics(num_bytes, ms, copy_gbps))
    del keys, values
    for rows in sample_rows:
        logits = torch.randn(rows, vocab_size, device=device) * 3
        temperature = torch.full((rows,), 0.8, device=device)
        seeds = torch.randint(0, 2**62, (rows,), device=device)
        positions = torch.randint(0, 4096, (rows,), device=device)
        args = (logits, temperature, seeds, positions)
        ms = _time_ms(functools.partial(triton_ops.gumbel_argmax, *args))
        torch_ms = _time_ms(functools.partial(reference.gumbel_argmax, *args))
        same = bool(torch.equal(triton_ops.gumbel_argmax(*args), reference.gumbel_argmax(*args)))
        metrics = _bandwidth_metrics(gumbel_argmax_bytes(rows, vocab_size), ms, copy_gbps)
        _report("gumbel_argmax", f"B={rows} V={vocab_size} fp32", ms, **metrics, torch_speedup=torch_ms / ms,
                same_as_torch=same)  # fmt: skip


def bench_lora(device, copy_gbps: float, **shapes) -> None:
    """The batched LoRA kernels (`bench.kernels_lora`'s cases), each next to a torch path (`torch_speedup`)."""
    for case in lora_bench_cases(device, DTYPE, **shapes):
        ms = _time_ms(case.triton)
        metrics = _bandwidth_metrics(case.num_bytes, ms, copy_gbps)
        _report(case.kernel, case.shape, ms, **metrics, torch_speedup=_time_ms(case.torch_path) / ms)


# CUDA measures one fixed shape (Llama-3-8B's attention, bf16); the CPU path defaults to SmolLM2-135M's, fp32.
_CPU_ONLY = ("heads", "head_dim", "dtype", "repeats", "prefill_lens")
_DEFAULTS = {
    "cuda": dict(batch=256, context_lens=[1024, 2048, 4096]),
    "cpu": dict(batch=48, context_lens=[256], heads=(9, 3), head_dim=64, dtype="float32", repeats=20,
                prefill_lens=[256, 200, 128, 64]),
}  # fmt: skip


def _heads(text: str) -> tuple[int, int]:
    q, _, kv = text.partition(":")
    try:
        num_q, num_kv = int(q), int(kv)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected Q:KV head counts, got {text!r}") from None
    if num_q < 1 or num_kv < 1 or num_q % num_kv:
        raise argparse.ArgumentTypeError(f"expected Q:KV with KV dividing Q, got {text!r}")
    return num_q, num_kv


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="pagedq bench kernels", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="cuda (the Triton kernels) or cpu (the CPU attention path; default when no GPU)",
    )
    parser.add_argument("--batch", type=int, default=None, help="decode batch size (default 256 on cuda, 48 on cpu)")
    parser.add_argument(
        "--context-lens",
        type=int,
        nargs="+",
        default=None,
        help="decode context lengths, one run each (default 1024 2048 4096 on cuda, 256 on cpu)",
    )
    parser.add_argument("--skip-elementwise", action="store_true", help="only the attention kernels (cuda)")
    parser.add_argument(
        "--heads", type=_heads, default=None, metavar="Q:KV", help="query:key-value heads (cpu only; default 9:3)"
    )
    parser.add_argument("--head-dim", type=int, default=None, help="head dimension (cpu only; default 64)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="cpu only; default float32")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per median (cpu only; default 20)")
    parser.add_argument(
        "--prefill-lens",
        type=int,
        nargs="+",
        default=None,
        help="prompt lengths of the prefill case (cpu only; default 256 200 128 64)",
    )
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help=f"KV block size (default {BLOCK_SIZE})")
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    given = [name for name in _CPU_ONLY if getattr(args, name) is not None]
    if args.device == "cuda" and given:
        parser.error(f"--{given[0].replace('_', '-')} applies to --device cpu only (cuda measures a fixed shape)")
    if args.device == "cuda" and args.block_size != BLOCK_SIZE:
        parser.error(f"--block-size applies to --device cpu only (cuda measures block size {BLOCK_SIZE})")
    for name, default in _DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("batch", "head_dim", "repeats", "block_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if min(args.context_lens) < 1 or min(args.prefill_lens or [1]) < 1:
        parser.error("context and prefill lengths must be positive")
    return args  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.device == "cpu":
        from pagedq.bench.kernels_cpu import main_cpu

        return main_cpu(args, _report)
    if not torch.cuda.is_available():
        print(
            "pagedq bench kernels: --device cuda needs a CUDA GPU (torch.cuda.is_available() is False); "
            "nothing measured."
        )
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name(device)}; bf16, block_size={BLOCK_SIZE}, timings are medians")
    copy_gbps = measure_copy_bandwidth(device)
    matmul_tflops = measure_matmul_tflops(device)
    for context_len in args.context_lens:
        bench_decode(device, args.batch, context_len, copy_gbps)
        torch.cuda.empty_cache()
    bench_prefill(device, [2048] * 8, [0] * 8, matmul_tflops)
    bench_prefill(device, [1024] * 4, [3072] * 4, matmul_tflops)
    if not args.skip_elementwise:
        bench_elementwise(device, copy_gbps)
        bench_copy_and_sampling(device, copy_gbps)
        bench_lora(device, copy_gbps)
        from pagedq.bench.kernels_moe import bench_fused_moe

        bench_fused_moe(device, matmul_tflops, _time_ms, _report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
