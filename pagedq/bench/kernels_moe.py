"""fused_moe benchmarks. On CUDA, `pagedq bench kernels` (bench.kernels) calls `bench_fused_moe`: the Triton kernels'
TFLOP/s next to the dense bf16 matmul and to the "cpu" backend's torch path on the same GPU tensors. On the CPU,
`python -m pagedq.bench.kernels_moe` compares that grouped path (kernels.cpu_moe) with the reference's loop over
every expert (kernels.reference, the oracle) on the same inputs: medians of the process's CPU time over --repeats
calls after one warm-up (on a shared machine wall time mostly measures the neighbours; run it with
OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE for a figure per core), one JSON line per case (prefix "JSON "):
`grouped_ms`, `reference_ms`, `speedup_over_reference`, `max_abs_diff_vs_reference`. Routing everywhere is a
softmax top-k over random logits.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from pagedq.kernels import cpu_moe, reference


def fused_moe_flops(num_tokens: int, top_k: int, hidden: int, intermediate: int) -> int:
    """Per (token, slot) pair: the gate/up GEMM (2I x H) and the down GEMM (H x I); padding rows not counted."""
    pairs = num_tokens * top_k
    return 2 * pairs * (2 * intermediate) * hidden + 2 * pairs * hidden * intermediate


# (label, tokens, experts, top_k, hidden, intermediate): Qwen3-30B-A3B decode and prefill, Mixtral-8x7B prefill.
MOE_CASES = [
    ("qwen3-moe", 64, 128, 8, 2048, 768),
    ("qwen3-moe", 4096, 128, 8, 2048, 768),
    ("mixtral", 4096, 8, 2, 4096, 14336),
]


def bench_fused_moe(
    device,
    matmul_tflops: float,
    time_ms: Callable[[Callable[[], object]], float],
    report: Callable[..., None],
    cases: Sequence[tuple[str, int, int, int, int, int]] = MOE_CASES,
) -> None:
    """fused_moe in bf16 next to the dense bf16 matmul and to the "cpu" backend's torch path (grouped by expert,
    one matmul pair per expert) run on the same GPU tensors; timed and reported with bench.kernels' helpers."""
    from pagedq.kernels import triton_ops

    for label, tokens, experts, top_k, hidden, intermediate in cases:
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
        w13 = torch.randn(experts, 2 * intermediate, hidden, dtype=torch.bfloat16, device=device) * hidden**-0.5
        w2 = torch.randn(experts, hidden, intermediate, dtype=torch.bfloat16, device=device) * intermediate**-0.5
        weights, ids = torch.topk(torch.randn(tokens, experts, device=device).softmax(-1), top_k, dim=-1)
        args = (x, w13, w2, weights, ids.to(torch.int32))
        ms = time_ms(functools.partial(triton_ops.fused_moe, *args))
        torch_ms = time_ms(functools.partial(cpu_moe.fused_moe, *args))
        diff = (triton_ops.fused_moe(*args).float() - cpu_moe.fused_moe(*args).float()).abs().max().item()
        tflops = fused_moe_flops(tokens, top_k, hidden, intermediate) / (ms * 1e-3) / 1e12
        shape = f"{label} T={tokens} E={experts} K={top_k} H={hidden} I={intermediate}"
        metrics = {"TFLOP/s": tflops, "matmul_TFLOP/s": matmul_tflops, "pct_of_matmul": 100.0 * tflops / matmul_tflops}
        report("fused_moe", shape, ms, **metrics, torch_grouped_speedup=torch_ms / ms, max_abs_diff=diff)
        del x, w13, w2, args


# (label, experts, top_k, hidden, intermediate): Qwen3-MoE's and Mixtral's expert counts and top-k at widths a
# shared CPU holds (fp32 weights of 200 MB and 50 MB).
CPU_MOE_SHAPES = [("qwen3-moe-like", 128, 8, 512, 256), ("mixtral-like", 8, 2, 512, 1024)]


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


def bench_cpu_fused_moe(
    token_counts: Sequence[int], repeats: int, shapes: Sequence[tuple[str, int, int, int, int]] = CPU_MOE_SHAPES
) -> list[dict]:
    records = []
    for label, experts, top_k, hidden, intermediate in shapes:
        w13 = torch.randn(experts, 2 * intermediate, hidden) * hidden**-0.5
        w2 = torch.randn(experts, hidden, intermediate) * intermediate**-0.5
        for tokens in token_counts:
            x = torch.randn(tokens, hidden)
            weights, ids = torch.topk(torch.randn(tokens, experts).softmax(-1), top_k, dim=-1)
            args = (x, w13, w2, weights, ids)
            grouped_ms = _median_ms(functools.partial(cpu_moe.fused_moe, *args), repeats)
            reference_ms = _median_ms(functools.partial(reference.fused_moe, *args), repeats)
            diff = (cpu_moe.fused_moe(*args) - reference.fused_moe(*args)).abs().max().item()
            record = {
                "kernel": "fused_moe (cpu)", "shape": f"{label} T={tokens} E={experts} K={top_k} H={hidden} "
                f"I={intermediate} fp32", "grouped_ms": round(grouped_ms, 3), "reference_ms": round(reference_ms, 3),
                "speedup_over_reference": round(reference_ms / grouped_ms, 2), "max_abs_diff_vs_reference": diff,
            }  # fmt: skip
            print("JSON " + json.dumps(record))
            records.append(record)
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedq.bench.kernels_moe", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256], help="T per case (default 1 16 256)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per median (default 10)")
    args = parser.parse_args(argv)
    if min(args.tokens) < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be positive")
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    print(f"device: cpu, {threads} intra-op threads; CPU-time medians of {args.repeats}")
    bench_cpu_fused_moe(args.tokens, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
