"""Builders of fused-MoE test inputs shared by the MoE kernel tests (not a test module)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoeCase:
    """Routing of T tokens to K of E experts; `idle_experts` get no token at all."""

    tokens: int
    top_k: int
    experts: int
    hidden: int = 80  # not a multiple of the 64-wide tiles: the column and depth masks matter
    intermediate: int = 48
    idle_experts: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"T{self.tokens}-K{self.top_k}-E{self.experts}-idle{len(self.idle_experts)}"


CASES = [
    MoeCase(tokens=1, top_k=1, experts=4),  # one decode token, one expert
    MoeCase(tokens=1, top_k=4, experts=8),  # one decode token, several experts
    MoeCase(tokens=3, top_k=3, experts=8, idle_experts=(0, 5)),
    MoeCase(tokens=40, top_k=2, experts=6, idle_experts=(2,)),  # several 16-row blocks per expert
    MoeCase(tokens=70, top_k=2, experts=4, idle_experts=(3,)),  # enough pairs per expert for 64-row blocks
]


def make_routing(case: MoeCase, device, id_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, K] fp32, topk_ids [T, K]): a softmax top-k over random logits, idle experts excluded."""
    logits = torch.randn(case.tokens, case.experts)
    logits[:, list(case.idle_experts)] = float("-inf")
    weights, ids = torch.topk(logits.softmax(dim=-1), case.top_k, dim=-1)
    return weights.to(device), ids.to(id_dtype).to(device)


def make_experts(case: MoeCase, dtype: torch.dtype, device, with_bias: bool) -> dict[str, torch.Tensor | None]:
    """w13 [E, 2I, H], w2 [E, H, I] scaled to keep activations O(1), and optional biases."""
    e, h, i = case.experts, case.hidden, case.intermediate
    w13 = torch.randn(e, 2 * i, h) * (2.0 / h**0.5)  # gate/up values of a few units: the clamps at 7 are reached
    w2 = torch.randn(e, h, i) / i**0.5
    w13_bias = torch.randn(e, 2 * i) if with_bias else None
    w2_bias = torch.randn(e, h) if with_bias else None

    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype).to(device)

    return {"w13": to(w13), "w2": to(w2), "w13_bias": to(w13_bias), "w2_bias": to(w2_bias)}
