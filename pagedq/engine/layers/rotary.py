"""The RoPE table: cos|sin of position * inv_freq, inv_freq from transformers' own init functions."""

from __future__ import annotations

import torch

from pagedq.engine.config.engine import ModelConfig


def rope_cos_sin_cache(config: ModelConfig, layer_type: str | None = None) -> torch.Tensor:
    """[max_positions, head_dim] fp32 = cat(cos, sin) of position * inv_freq, inv_freq from transformers.
    layer_type: for configs whose rope_parameters hold one dict per layer type (Gemma 3), the one to use."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = config.hf_config
    rope_parameters = getattr(hf, "rope_parameters", None) or {}
    if layer_type is not None:
        rope_parameters = rope_parameters[layer_type]
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        base = rope_parameters["rope_theta"]
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float, device="cpu") / config.head_dim
        inv_freq = 1.0 / (base**exponents)
        scaling = 1.0
    else:
        per_layer_type = {} if layer_type is None else {"layer_type": layer_type}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), **per_layer_type)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float, device="cpu")
    freqs = positions[:, None] * inv_freq.float().cpu()[None, :]
    table = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
    return table.to(torch.get_default_device())
