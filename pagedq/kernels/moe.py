"""fused_moe on Triton: the routed experts of a mixture-of-experts layer as two grouped GEMMs.

Shapes and strides (the contract is `reference.fused_moe`)
    hidden       [T, H]      last dim contiguous
    w13          [E, 2I, H]  rows 0..I-1 gate, I..2I-1 up; any strides
    w2           [E, H, I]   any strides
    topk_weights [T, K]      fp32 (other float dtypes are widened)
    topk_ids     [T, K]      int32 or int64, values in [0, E) (not checked: that would cost a device sync)
    w13_bias [E, 2I], w2_bias [E, H] or None
    -> out       [T, H]      hidden's dtype

The N = T*K (token, slot) pairs are numbered pair = t*K + k. `align_pairs_by_expert` sorts them by expert and
pads each expert's group to a multiple of BLOCK_M with the out-of-range id N, all in torch on the device, with no
host sync (so a decode step stays capturable in a CUDA graph): every BLOCK_M rows of the sorted list then
belong to one expert, which `block_experts` names (-1 past the last group). The grid is sized for the worst
case, N + min(E, N) * (BLOCK_M - 1) rows; programs whose block holds no group return at once.

Kernel 1, gate/up: a program computes BLOCK_M pairs x BLOCK_N intermediate columns of its expert with two fp32
accumulators (gate and up columns), applies the activation and stores act [N, I] at the pairs' rows. Kernel 2,
down: act @ w2[e].T + bias for BLOCK_M pairs x BLOCK_N hidden columns, times the pair's routing weight, stored
in hidden's dtype at the pair's row of [N, H]; the K rows of a token are then summed (fp32 accumulation, torch;
no atomics, so the result is deterministic). Both kernels round to the input dtype where the reference rounds
(the projections, silu, each elementwise step of swiglu_oai).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels.reference import MOE_ACTIVATIONS, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, check_moe_activation
from pagedq.kernels.triton_common import (
    check_float_dtype,
    check_int_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    dot_fp32_acc,
    needs_bf16_rounding_by_hand,
    needs_dot_upcast,
    round_to,
)

# Average pairs per expert above which the tall tile pays: decode batches leave most experts with a few rows.
LARGE_BLOCK_M_MIN_PAIRS_PER_EXPERT = 32


def align_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pair_ids [P] int32, block_experts [P / block_m] int32) for topk_ids [T, K], on its device.

    sorted_pair_ids lists the pairs (t*K + k) grouped by expert in ascending expert order, each group in pair
    order and padded to a multiple of block_m with N = T*K; block_experts[b] is the expert of rows
    b*block_m .. (b+1)*block_m - 1, or -1 for blocks past the last group. P is the worst case for any routing:
    N + min(E, N) * (block_m - 1), rounded up to block_m.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = topk_ids.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    group_starts = torch.cumsum(counts, 0) - counts
    rank_in_group = torch.arange(num_pairs, device=device) - group_starts[sorted_experts]
    destinations = (padded_ends - padded_counts)[sorted_experts] + rank_in_group
    worst_case = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = triton.cdiv(worst_case, block_m)
    sorted_pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[destinations] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_pair_ids, block_experts


@triton.jit
def _moe_gate_up_kernel(
    hidden_ptr,
    w13_ptr,
    bias_ptr,
    act_ptr,
    sorted_pair_ids_ptr,
    block_experts_ptr,
    num_pairs,
    hidden_size,
    intermediate,
    stride_hidden_row,
    stride_w13_expert,
    stride_w13_row,
    stride_w13_col,
    stride_bias_expert,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU_OAI: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
):
    num_col_blocks = tl.cdiv(intermediate, BLOCK_N)
    block_m = tl.program_id(0) // num_col_blocks
    block_n = tl.program_id(0) % num_col_blocks
    expert = tl.load(block_experts_ptr + block_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_pair_ids_ptr + block_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < intermediate
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = hidden_ptr + tokens[:, None] * stride_hidden_row + ks[None, :]
    # [BLOCK_K, BLOCK_N] tiles of w13[e].T: gate rows `cols`, up rows `intermediate + cols`
    gate_ptrs = w13_ptr + expert * stride_w13_expert + cols[None, :] * stride_w13_row + ks[:, None] * stride_w13_col
    up_ptrs = gate_ptrs + intermediate * stride_w13_row
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, hidden_size, BLOCK_K):
        k_mask = ks < hidden_size - k_start
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        acc_gate = dot_fp32_acc(a, tl.load(gate_ptrs, mask=w_mask, other=0.0), acc_gate, UPCAST_DOT)
        acc_up = dot_fp32_acc(a, tl.load(up_ptrs, mask=w_mask, other=0.0), acc_up, UPCAST_DOT)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * stride_w13_col
        up_ptrs += BLOCK_K * stride_w13_col
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_bias_expert
        acc_gate += tl.load(bias_row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias_row + intermediate + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ty = act_ptr.dtype.element_ty
    gate = round_to(acc_gate, out_ty, RNE_BY_HAND).to(tl.float32)
    up = round_to(acc_up, out_ty, RNE_BY_HAND).to(tl.float32)
    if SWIGLU_OAI:  # rounded after every operation, as the reference's elementwise torch ops round
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        scaled = round_to(gate * ALPHA, out_ty, RNE_BY_HAND).to(tl.float32)
        sigmoid = round_to(1.0 / (1.0 + tl.exp(-scaled)), out_ty, RNE_BY_HAND).to(tl.float32)
        glu = round_to(gate * sigmoid, out_ty, RNE_BY_HAND).to(tl.float32)
        act = round_to(up + 1.0, out_ty, RNE_BY_HAND).to(tl.float32) * glu
    else:
        act = round_to(gate / (1.0 + tl.exp(-gate)), out_ty, RNE_BY_HAND).to(tl.float32) * up
    act_ptrs = act_ptr + pairs.to(tl.int64)[:, None] * intermediate + cols[None, :]
    tl.store(act_ptrs, round_to(act, out_ty, RNE_BY_HAND), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _moe_down_kernel(
    act_ptr,
    w2_ptr,
    bias_ptr,
    weights_ptr,
    out_ptr,
    sorted_pair_ids_ptr,
    block_experts_ptr,
    num_pairs,
    hidden_size,
    intermediate,
    stride_w2_expert,
    stride_w2_row,
    stride_w2_col,
    stride_bias_expert,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
):
    num_col_blocks = tl.cdiv(hidden_size, BLOCK_N)
    block_m = tl.program_id(0) // num_col_blocks
    block_n = tl.program_id(0) % num_col_blocks
    expert = tl.load(block_experts_ptr + block_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_pair_ids_ptr + block_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    rows = pairs.to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden_size
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * intermediate + ks[None, :]
    w_ptrs = w2_ptr + expert * stride_w2_expert + cols[None, :] * stride_w2_row + ks[:, None] * stride_w2_col
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, intermediate, BLOCK_K):
        k_mask = ks < intermediate - k_start
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = dot_fp32_acc(a, w, acc, UPCAST_DOT)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w2_col
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_expert + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    routing_weight = tl.load(weights_ptr + rows, mask=row_mask, other=0.0)
    weighted = round_to(acc, out_ty, RNE_BY_HAND).to(tl.float32) * routing_weight[:, None]
    out_ptrs = out_ptr + rows[:, None] * hidden_size + cols[None, :]
    tl.store(out_ptrs, round_to(weighted, out_ty, RNE_BY_HAND), mask=row_mask[:, None] & col_mask[None, :])


def _check_inputs(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation) -> None:
    fn = "fused_moe"
    check_moe_activation(activation)
    check_ndim(fn, "hidden", hidden, 2, "[T, H]")
    check_ndim(fn, "w13", w13, 3, "[E, 2I, H]")
    check_ndim(fn, "w2", w2, 3, "[E, H, I]")
    check_float_dtype(fn, "hidden", hidden)
    check_last_dim_contiguous(fn, "hidden", hidden)
    num_experts, hidden_size = w13.shape[0], hidden.shape[1]
    if w13.shape[1] % 2 != 0 or w13.shape[2] != hidden_size:
        raise ValueError(f"{fn}: w13 must be [E, 2I, H] with H = {hidden_size}, got {tuple(w13.shape)}")
    intermediate = w13.shape[1] // 2
    if tuple(w2.shape) != (num_experts, hidden_size, intermediate):
        expected = (num_experts, hidden_size, intermediate)
        raise ValueError(f"{fn}: w2 must be [E, H, I] = {expected}, got {tuple(w2.shape)}")
    for name, weight in (("w13", w13), ("w2", w2)):
        if weight.dtype != hidden.dtype:
            raise ValueError(f"{fn}: {name} dtype {weight.dtype} must match hidden's {hidden.dtype}")
    check_ndim(fn, "topk_ids", topk_ids, 2, "[T, K]")
    check_int_dtype(fn, "topk_ids", topk_ids, (torch.int32, torch.int64))
    if topk_ids.shape[0] != hidden.shape[0] or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"{fn}: topk_ids and topk_weights must both be [T, K] with T = {hidden.shape[0]}, got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    check_float_dtype(fn, "topk_weights", topk_weights)
    biases = {"w13_bias": (w13_bias, (num_experts, 2 * intermediate)), "w2_bias": (w2_bias, (num_experts, hidden_size))}
    for name, (bias, shape) in biases.items():
        if bias is None:
            continue
        if tuple(bias.shape) != shape:
            raise ValueError(f"{fn}: {name} must be {shape}, got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise ValueError(f"{fn}: {name} dtype {bias.dtype} must match hidden's {hidden.dtype}")
        check_last_dim_contiguous(fn, name, bias)
    tensors = {"hidden": hidden, "w13": w13, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids}
    present_biases = {name: bias for name, (bias, _) in biases.items() if bias is not None}
    check_same_device(fn, **tensors, **present_biases)


def block_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes and launch options for both kernels: a short BLOCK_M when experts get few rows each (decode),
    so padding wastes little; half-depth K tiles in fp32, whose operands take twice the shared memory."""
    large = num_pairs >= LARGE_BLOCK_M_MIN_PAIRS_PER_EXPERT * num_experts
    return {
        "BLOCK_M": 64 if large else 16,
        "BLOCK_N": 64,
        "BLOCK_K": 32 if dtype == torch.float32 else 64,
        "num_warps": 4,
        "num_stages": 3,
    }


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """The routed experts' output [T, H]: `reference.fused_moe`'s contract, on two grouped GEMM kernels."""
    _check_inputs(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    config = block_config(num_pairs, num_experts, hidden.dtype)
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    sorted_pair_ids, block_experts = align_pairs_by_expert(topk_ids, num_experts, block_m)
    num_blocks = block_experts.shape[0]
    act = torch.empty((num_pairs, intermediate), dtype=hidden.dtype, device=hidden.device)
    interpreter_fixes = {
        "UPCAST_DOT": needs_dot_upcast(_moe_gate_up_kernel, hidden.dtype),
        "RNE_BY_HAND": needs_bf16_rounding_by_hand(_moe_gate_up_kernel, hidden.dtype),
    }
    bias13 = w13 if w13_bias is None else w13_bias  # any pointer when there is no bias: HAS_BIAS skips the loads
    _moe_gate_up_kernel[(num_blocks * triton.cdiv(intermediate, block_n),)](
        hidden, w13, bias13, act, sorted_pair_ids, block_experts,
        num_pairs, hidden_size, intermediate, hidden.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
        bias13.stride(0), TOP_K=top_k, HAS_BIAS=w13_bias is not None, SWIGLU_OAI=activation == "swiglu_oai",
        ALPHA=SWIGLU_OAI_ALPHA, LIMIT=SWIGLU_OAI_LIMIT, **interpreter_fixes, **config,
    )  # fmt: skip
    weighted = torch.empty((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    bias2 = w2 if w2_bias is None else w2_bias
    _moe_down_kernel[(num_blocks * triton.cdiv(hidden_size, block_n),)](
        act, w2, bias2, topk_weights.reshape(-1).float(), weighted, sorted_pair_ids, block_experts,
        num_pairs, hidden_size, intermediate, w2.stride(0), w2.stride(1), w2.stride(2), bias2.stride(0),
        HAS_BIAS=w2_bias is not None, **interpreter_fixes, **config,
    )  # fmt: skip
    return weighted.view(num_tokens, top_k, hidden_size).sum(dim=1)


__all__ = ["MOE_ACTIVATIONS", "align_pairs_by_expert", "block_config", "fused_moe"]
