"""Adapter slots on the device: each adapted linear of the model holds `max_loras` adapters stacked and
pre-allocated at `max_lora_rank`, and adds the step's adapters to its output with the shrink / expand kernels.

    y = base(x);  lora_add(y, x, lora_a, lora_b, index, out_sizes)   (lora_expand of lora_shrink)

A packed linear holds one slice per projection it packs (qkv_proj: q, k, v; gate_up_proj: gate, up). An adapter
of rank r < max_lora_rank fills the first r rows of A and columns of B, the rest stays zero; a projection the
adapter does not target stays zero too, so every slot computes the same shapes.

The step's `LoRAIndex` (which slot each token uses, -1 for the base model) is built once per step by the model
runner and set on `LoRASlots.step_index` before the forward pass, which every adapted linear reads: the model
code and its forward signatures stay unaware of adapters (any architecture with these projection names is
served). A step without adapter tokens has no index and costs nothing here.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from pagedq.engine.lora.adapter import LoRAAdapter, ModelTargets
from pagedq.kernels import KernelSet
from pagedq.kernels.lora import LoRAIndex

# The model's projections an adapter may target: (module attribute under a decoder layer, its projections in order).
_ADAPTED = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", "o_proj", ("o_proj",)),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp", "down_proj", ("down_proj",)),
)


class LoRALinear(nn.Module):
    """A linear layer plus the adapters of `max_loras` slots on its projections (see the module doc)."""

    lora_a: torch.Tensor  # [max_loras, projections, max_rank, in]
    lora_b: torch.Tensor  # [max_loras, projections, max out, max_rank]

    def __init__(
        self, base: nn.Linear, projections: tuple[str, ...], slots: LoRASlots, max_loras: int, max_rank: int
    ) -> None:
        super().__init__()
        self.base, self.projections, self.slots, self.ops = base, projections, slots, slots.ops
        offsets = getattr(base, "shard_offsets", [0, base.out_features])
        self.out_sizes = tuple(hi - lo for lo, hi in itertools.pairwise(offsets))
        dtype, device, count = base.weight.dtype, base.weight.device, len(projections)
        a_shape = (max_loras, count, max_rank, base.in_features)
        b_shape = (max_loras, count, max(self.out_sizes), max_rank)
        self.register_buffer("lora_a", torch.zeros(a_shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(b_shape, dtype=dtype, device=device), persistent=False)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        index = self.slots.step_index
        if index is None:
            return y
        self.ops.lora_add(y, x, self.lora_a, self.lora_b, index, self.out_sizes)
        return y

    def set_slot(self, slot: int, layer: int, adapter: LoRAAdapter | None) -> None:
        """Copy the adapter's matrices of this layer's projections into `slot` (zeros where it has none)."""
        a_slot, b_slot = self.lora_a[slot], self.lora_b[slot]
        a_slot.zero_()
        b_slot.zero_()
        if adapter is None:
            return
        for n, projection in enumerate(self.projections):
            pair = adapter.weights.get((layer, projection))
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            a_slot[n, :rank].copy_(a, non_blocking=True)
            b_slot[n, : b.shape[0], :rank].copy_(b, non_blocking=True)


class LoRASlots:
    """The model's adapted linears and the per-step index they read; loads adapters into slots."""

    def __init__(self, model: nn.Module, ops: KernelSet, max_loras: int, max_rank: int) -> None:
        self.ops, self.max_loras, self.max_rank = ops, max_loras, max_rank
        self.step_index: LoRAIndex | None = None  # set by the model runner for the step being computed
        self.layers: list[tuple[int, LoRALinear]] = []
        shapes: dict[str, tuple[int, int]] = {}
        decoder_layers: nn.ModuleList = model.model.layers  # type: ignore[union-attr,assignment]
        for number, layer in enumerate(decoder_layers):
            for parent_name, attribute, projections in _ADAPTED:
                parent = getattr(layer, parent_name, None)
                base = getattr(parent, attribute, None) if parent is not None else None
                if not isinstance(base, nn.Linear):  # e.g. a mixture-of-experts block in place of the MLP
                    continue
                wrapped = LoRALinear(base, projections, self, max_loras, max_rank)
                setattr(parent, attribute, wrapped)
                self.layers.append((number, wrapped))
                for projection, out_size in zip(projections, wrapped.out_sizes):
                    shapes[projection] = (base.in_features, out_size)
        self.targets = ModelTargets(shapes, len(decoder_layers))

    def load(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Fill `slot` with the adapter's weights (device work: run in order with the steps, never during one)."""
        for number, layer in self.layers:
            layer.set_slot(slot, number, adapter)

    @property
    def num_bytes(self) -> int:
        return sum(layer.lora_a.nbytes + layer.lora_b.nbytes for _, layer in self.layers)
