"""The sparse mixture-of-experts block (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss): a router, top-k routing, SwiGLU
experts stacked into two tensors for one fused call, and the optional sigmoid-gated shared expert. gpt-oss's options
(MoeConfig): routing by top-k of the logits then softmax, biases on the router and the experts, the clamped SwiGLU.

Routing follows transformers' routers step for step (router logits in the model dtype, softmax in fp32, torch.topk
on the probabilities, so ties go where transformers sends them), because a different expert choice is a different
model, not a rounding difference.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedq.engine.config.engine import ModelConfig
from pagedq.engine.config.moe import MoeConfig
from pagedq.engine.layers.linear import Linear
from pagedq.engine.layers.mlp import MLP
from pagedq.kernels import KernelSet


def route(router_logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """router logits [T, E] -> (top-k weights [T, K] fp32, expert ids [T, K] int64): softmax over all experts in
    fp32, the k largest probabilities, renormalised to sum 1 when the config says so; for "topk_softmax" (gpt-oss)
    the k largest logits, then a softmax over those k in the logits' dtype, as GptOssTopKRouter."""
    if moe.scoring == "topk_softmax":
        top_logits, ids = torch.topk(router_logits, moe.num_experts_per_tok, dim=-1)
        return torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype).float(), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, moe.num_experts_per_tok, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if moe.weights_in_model_dtype:
        weights = weights.to(router_logits.dtype).float()
    return weights, ids


class Experts(nn.Module):
    """Every routed expert's weights, stacked: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]; with
    `bias`, w13_bias [E, 2I] and w2_bias [E, H] (gpt-oss).

    Checkpoints hold one matrix per expert and projection; `load_expert` copies each into its place.
    """

    PROJECTIONS = ("gate", "up", "down")
    BIAS_PROJECTIONS = ("gate_bias", "up_bias", "down_bias")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None

    @property
    def projections(self) -> tuple[str, ...]:
        """What the checkpoint must give for each expert (the loader's completeness check)."""
        return self.PROJECTIONS + (self.BIAS_PROJECTIONS if self.w13_bias is not None else ())

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor) -> None:
        """Copy one expert's gate, up or down matrix (checkpoint layout [out, in]) into the stacked tensors."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config has {self.num_experts} experts")
        size = self.intermediate_size
        target = {
            "gate": self.w13.data[expert, :size],
            "up": self.w13.data[expert, size:],
            "down": self.w2.data[expert],
        }[projection]
        if tensor.shape != target.shape:
            raise ValueError(
                f"expert {expert}'s {projection} matrix has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor)


class SparseMoeBlock(nn.Module):
    """out = sum over the token's top-k experts of weight * expert(x), plus sigmoid(gate(x)) * shared(x) where the
    config has a shared expert. Module names follow the Qwen checkpoints (mlp.gate, mlp.experts, mlp.shared_expert,
    mlp.shared_expert_gate); the loader maps Mixtral's and gpt-oss's names (mlp.router) onto them."""

    def __init__(self, config: ModelConfig, ops: KernelSet) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None, "SparseMoeBlock is built for mixture-of-experts configs only"
        self.moe = moe
        self.ops = ops
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=moe.biases)
        self.experts = Experts(moe.num_experts, config.hidden_size, moe.moe_intermediate_size, bias=moe.biases)
        self.shared_expert: MLP | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, ops, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.moe)
        experts = self.experts
        out = self.ops.fused_moe(
            x,
            experts.w13,
            experts.w2,
            weights,
            ids,
            w13_bias=experts.w13_bias,
            w2_bias=experts.w2_bias,
            activation=self.moe.activation,
        )
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def feed_forward(config: ModelConfig, ops: KernelSet, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: the expert block where the config makes that layer sparse, else the dense MLP."""
    if config.moe is not None and layer in config.moe.sparse_layers:
        return SparseMoeBlock(config, ops)
    return MLP(config, ops)
