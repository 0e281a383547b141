"""`python -m pagedq.bench.moe_cpu`: fused_moe on the CPU, the "cpu" backend's grouped path (kernels.cpu_moe)
next to the reference's loop over every expert (kernels.reference, the oracle), on the same inputs.

Softmax top-k routing over random logits; medians over --repeats calls after one warm-up. One JSON line per
case (prefix "JSON "): `grouped_ms`, `reference_ms`, `speedup_over_reference`, `max_abs_diff_vs_reference`.
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

# (label, experts, top_k, hidden, intermediate): Qwen3-MoE's and Mixtral's expert counts and top-k at widths a
# shared CPU holds (fp32 weights of 200 MB and 50 MB).
CPU_MOE_SHAPES = [("qwen3-moe-like", 128, 8, 512, 256), ("mixtral-like", 8, 2, 512, 1024)]


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
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
    parser = argparse.ArgumentParser(prog="python -m pagedq.bench.moe_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256], help="T per case (default 1 16 256)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per median (default 10)")
    args = parser.parse_args(argv)
    if min(args.tokens) < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be positive")
    torch.manual_seed(0)
    print(f"device: cpu, {torch.get_num_threads()} intra-op threads; timings are medians of {args.repeats}")
    bench_cpu_fused_moe(args.tokens, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
