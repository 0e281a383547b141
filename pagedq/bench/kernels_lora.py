"""The batched LoRA kernels' cases of `pagedq bench kernels`.

CUDA (`lora_bench_cases`, which the CUDA bench times): lora_shrink and lora_expand next to the torch reference (a
gather of each token's weights), and lora_add, the two kernels as the layer calls them, next to the slot-grouped
torch path (the CPU backend's); each with its compulsory bytes (inputs read once, outputs written once).

CPU (`bench_cpu_lora`): one decoder layer's LoRA calls (qkv_proj, o_proj, gate_up_proj, down_proj) by the CPU
path as it dispatches, by its native kernel and by its torch ops, next to the reference.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from pagedq.kernels import cpu_lora, cpu_native, lora


def lora_shrink_bytes(num_tokens: int, in_dim: int, num_slices: int, rank: int, active_slots: int,
                      elem_bytes: int) -> int:  # fmt: skip
    """Read x and the A of every slot the step uses, write the fp32 buffer."""
    return (
        num_tokens * in_dim + active_slots * num_slices * rank * in_dim
    ) * elem_bytes + num_slices * num_tokens * rank * 4


def lora_expand_bytes(num_tokens: int, out_sizes: Sequence[int], rank: int, active_slots: int, elem_bytes: int) -> int:
    """Read the fp32 buffer and the used rows of every used slot's B, read and write y."""
    buffer = len(out_sizes) * num_tokens * rank * 4
    return buffer + (active_slots * sum(out_sizes) * rank + 2 * num_tokens * sum(out_sizes)) * elem_bytes


@dataclass(frozen=True)
class LoRABenchCase:
    """One timed call: the Triton kernel, a torch path on the same inputs, its compulsory bytes."""

    kernel: str
    shape: str
    triton: Callable[[], object]
    torch_path: Callable[[], object]
    num_bytes: int


DEFAULT_CASES = ((64, 16), (64, 64), (4096, 16))  # (tokens, rank): decode at two ranks, then a prefill


def lora_bench_cases(device: torch.device, dtype: torch.dtype = torch.bfloat16, hidden: int = 4096,
                     kv_out: int = 1024, num_slots: int = 8,
                     cases: Sequence[tuple[int, int]] = DEFAULT_CASES) -> list[LoRABenchCase]:  # fmt: skip
    """lora_shrink, lora_expand and lora_add on a qkv_proj (N = 3, GQA out sizes), per (tokens, rank), the tokens
    spread round-robin over `num_slots` adapters."""
    from pagedq.kernels import triton_ops

    out_sizes = (hidden, kv_out, kv_out)
    elem = torch.empty((), dtype=dtype).element_size()
    outs = "+".join(map(str, out_sizes))
    timed: list[LoRABenchCase] = []
    for tokens, rank in cases:
        index = lora.LoRAIndex.build(torch.arange(tokens, dtype=torch.int32) % num_slots, num_slots, device)
        x = torch.randn(tokens, hidden, dtype=dtype, device=device)
        lora_a = torch.randn(num_slots, 3, rank, hidden, dtype=dtype, device=device) / hidden**0.5
        lora_b = torch.randn(num_slots, 3, max(out_sizes), rank, dtype=dtype, device=device) / rank**0.5
        y = torch.randn(tokens, sum(out_sizes), dtype=dtype, device=device)
        buf = triton_ops.lora_shrink(x, lora_a, index)
        active = len(index.host_segments)
        timed += [
            LoRABenchCase("lora_shrink", f"T={tokens} in={hidden} N=3 R={rank} S={num_slots}",
                          partial(triton_ops.lora_shrink, x, lora_a, index),
                          partial(lora.lora_shrink, x, lora_a, index),
                          lora_shrink_bytes(tokens, hidden, 3, rank, active, elem)),
            LoRABenchCase("lora_expand", f"T={tokens} out={outs} R={rank} S={num_slots}",
                          partial(triton_ops.lora_expand, y, buf, lora_b, index, out_sizes),
                          partial(lora.lora_expand, y, buf, lora_b, index, out_sizes),
                          lora_expand_bytes(tokens, out_sizes, rank, active, elem)),
            LoRABenchCase("lora_add", f"T={tokens} in={hidden} out={outs} R={rank} S={num_slots}",
                          partial(triton_ops.lora_add, y, x, lora_a, lora_b, index, out_sizes),
                          partial(cpu_lora.grouped_lora_add, y, x, lora_a, lora_b, index, out_sizes),
                          lora_shrink_bytes(tokens, hidden, 3, rank, active, elem)
                          + lora_expand_bytes(tokens, out_sizes, rank, active, elem)),
        ]  # fmt: skip
    return timed


CPU_LORA_SLOTS, CPU_LORA_RANK = 8, 16
# Weights of this many layers, used in turn: a model's LoRA weights outgrow the caches, so each layer's come from
# memory, as they do in the engine.
CPU_LORA_LAYERS = 30


Linear = tuple[int, tuple[int, ...]]  # a LoRA'd projection: its input width and its output slices' widths
LayerWeights = list[tuple[torch.Tensor, torch.Tensor]]  # each projection's stacked (lora_a, lora_b)


def bench_cpu_lora(args: argparse.Namespace, timer: Callable[[Callable[[], object], int], float],
                   report: Callable[..., None]) -> None:  # fmt: skip
    """A decoder layer's four LoRA calls at decode (--batch tokens) and at prefill (the --prefill-lens prompts),
    the tokens spread over 8 adapters of rank 16 (a prompt's tokens all on one), the projections' sizes from
    --heads and --head-dim (SmolLM2-135M's by default; the MLP 8/3 of the hidden size). `ms` is the path
    `grouped_lora_add` takes; `native_ms` its native kernel (null where it does not take it), `torch_ops_ms` its
    torch ops (`torch_ops_lora_add`); `reference_ms` the reference."""
    num_q_heads, num_kv_heads = args.heads
    hidden, kv_out = num_q_heads * args.head_dim, num_kv_heads * args.head_dim
    ffn = 8 * hidden // 3
    dtype = getattr(torch, args.dtype)
    linears: list[Linear] = [(hidden, (hidden, kv_out, kv_out)), (hidden, (hidden,)), (hidden, (ffn, ffn)),
                             (ffn, (hidden,))]  # fmt: skip
    layers = [
        [(torch.randn(CPU_LORA_SLOTS, len(outs), CPU_LORA_RANK, in_dim).div(in_dim**0.5).to(dtype),
          torch.randn(CPU_LORA_SLOTS, len(outs), max(outs), CPU_LORA_RANK).div(CPU_LORA_RANK**0.5).to(dtype))
         for in_dim, outs in linears]
        for _ in range(CPU_LORA_LAYERS)
    ]  # fmt: skip
    steps = {
        "decode": torch.arange(args.batch, dtype=torch.int32) % CPU_LORA_SLOTS,
        "prefill": torch.cat(
            [torch.full((n,), i % CPU_LORA_SLOTS, dtype=torch.int32) for i, n in enumerate(args.prefill_lens)]
        ),
    }
    sizes = ", ".join(f"{in_dim}/{'+'.join(map(str, outs))}" for in_dim, outs in linears)
    for step, token_slots in steps.items():
        tokens = token_slots.shape[0]
        shape = f"{step} T={tokens} S={CPU_LORA_SLOTS} R={CPU_LORA_RANK} in/out {sizes} {args.dtype}"
        report("cpu lora_add layer", shape, **_time_lora_step(args, timer, token_slots, linears, layers, dtype))


def _time_lora_step(args: argparse.Namespace, timer: Callable[[Callable[[], object], int], float],
                    token_slots: torch.Tensor, linears: list[Linear], layers: list[LayerWeights],
                    dtype: torch.dtype) -> dict[str, float | None]:  # fmt: skip
    index = lora.LoRAIndex.build(token_slots, CPU_LORA_SLOTS)
    tokens = token_slots.shape[0]
    xs = [torch.randn(tokens, in_dim).to(dtype) for in_dim, _ in linears]
    ys = [torch.randn(tokens, sum(outs)).to(dtype) for _, outs in linears]
    turn = itertools.cycle(layers)

    def layer(add: Callable[..., None]) -> None:
        for (_, outs), x, y, (lora_a, lora_b) in zip(linears, xs, ys, next(turn), strict=True):
            add(y, x, lora_a, lora_b, index, outs)

    def native_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   index: lora.LoRAIndex, out_sizes: tuple[int, ...]) -> None:  # fmt: skip
        cpu_native.lora_add(y, x, lora_a, lora_b, index.token_order, index.slot_starts, index.slot_lengths, out_sizes)

    max_diff = _max_diff(layers[0], linears, xs, ys, index)  # before the timed calls add to ys
    path_ms = timer(partial(layer, cpu_lora.grouped_lora_add), args.repeats)
    native = cpu_lora.runs_native(ys[0], xs[0], *layers[0][0], index)
    native_ms = timer(partial(layer, native_add), args.repeats) if native else None
    torch_ops_ms = timer(partial(layer, cpu_lora.torch_ops_lora_add), args.repeats)
    reference_ms = timer(partial(layer, lora.lora_add), args.repeats)
    return {"ms": path_ms, "native_ms": native_ms, "torch_ops_ms": torch_ops_ms,
            "native_over_torch_ops": None if native_ms is None else native_ms / torch_ops_ms,
            "reference_ms": reference_ms, "max_abs_diff_vs_reference": max_diff}  # fmt: skip


def _max_diff(weights: LayerWeights, linears: list[Linear],
              xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], index: lora.LoRAIndex) -> float:  # fmt: skip
    """The CPU path's largest difference from the reference over one layer's four calls."""
    worst = 0.0
    for (_, outs), x, y, (lora_a, lora_b) in zip(linears, xs, ys, weights, strict=True):
        path, expected = y.clone(), y.clone()
        cpu_lora.grouped_lora_add(path, x, lora_a, lora_b, index, outs)
        lora.lora_add(expected, x, lora_a, lora_b, index, outs)
        worst = max(worst, (path.float() - expected.float()).abs().max().item())
    return worst
