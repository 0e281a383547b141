"""fused_moe for the "cpu" backend: the reference's math, grouped by expert instead of masked per expert.

The reference scans all T*K routing ids once per expert (E `where` passes, most of them empty with many
experts). Here the (token, slot) pairs are sorted by expert once, the expert sizes read back once, and each
expert with work runs two matmuls over its contiguous group of rows; the weighted rows go back to their tokens
in one index_add. Same projections in the input dtype and the same fp32 sum over k as `reference.fused_moe`.
"""

from __future__ import annotations

import torch

from pagedq.kernels.reference import check_moe_activation, moe_activation


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
    """Same contract as `reference.fused_moe`; a routing id outside [0, E) raises ValueError."""
    check_moe_activation(activation)
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).long()
    if flat_ids.numel() == 0:
        return torch.zeros_like(hidden)
    low, high = int(flat_ids.min()), int(flat_ids.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"fused_moe: topk_ids must lie in [0, {num_experts}), got ids from {low} to {high}")
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    tokens = order // top_k
    grouped = hidden[tokens]
    expert_out = torch.empty((order.numel(), w2.shape[1]), dtype=hidden.dtype, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate_up = _linear(grouped[rows], w13[expert], None if w13_bias is None else w13_bias[expert])
        _linear(_activate(gate_up, activation), w2[expert], None if w2_bias is None else w2_bias[expert],
                out=expert_out[rows])  # fmt: skip
        start += count
    weighted = expert_out.float()  # expert_out itself when fp32: it is ours to scale in place
    weighted.mul_(topk_weights.reshape(-1)[order].float()[:, None])
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, tokens, weighted)
    return out.to(hidden.dtype)


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias), written into `out` when given: F.linear's product, without the copy into place."""
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def _activate(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """`reference.moe_activation`; silu in place in gate_up's gate half (the same two roundings, no new buffers)."""
    if activation != "silu":
        return moe_activation(gate_up, activation)
    half = gate_up.shape[-1] // 2
    gate = torch.nn.functional.silu(gate_up[:, :half], inplace=True)
    return gate.mul_(gate_up[:, half:])
