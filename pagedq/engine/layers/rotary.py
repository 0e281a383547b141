"""The RoPE table: cos|sin of position * inv_freq, inv_freq and the cos/sin scale from transformers' own init functions.

A paged cache holds each key rotated once, when it is written, so the table is static: a row per position (and, for
LongRoPE, extra rows, below). transformers' `dynamic` and `longrope` recompute inv_freq from the forward's sequence
length (`dynamic_rope_update`); the table keeps what that gives a single sequence generated token by token:

- dynamic NTK: row p holds inv_freq for a sequence of p + 1 tokens: the checkpoint's own frequencies up to
  max_position_embeddings, the NTK-stretched base past it (what transformers gives a decode step at p);
- LongRoPE: two sets, chosen per sequence by the longest it may grow (prompt + max_tokens): one that fits
  original_max_position_embeddings uses the short factors, as transformers does while a sequence fits it; any other
  the long factors at every position, as transformers does once a sequence outgrows it (its Phi-3 then recomputes
  the whole cache with them). Rows [0, max_len) hold the long set, rows [max_len, max_len + original_max) the short
  one: `rope_table_rows` says which row a token reads. docs/engine.md#rope-scalings has the one case transformers
  computes otherwise.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedq.engine.config.engine import ModelConfig, rope_parameters_of


def rope_cos_sin_cache(config: ModelConfig, layer_type: str | None = None) -> torch.Tensor:
    """[rows, head_dim] fp32 = cat(cos, sin) of position * inv_freq, times the type's attention scaling (YaRN's
    mscale, LongRoPE's factor), as transformers' rotary embeddings compute them.

    `layer_type` selects one entry of a per-layer-type `rope_parameters` dict (Gemma 3's sliding/full bases), as
    transformers' init functions take it; None reads the model's single `rope_parameters`.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = config.hf_config
    params = rope_parameters_of(hf, layer_type)
    rope_type = params.get("rope_type", "default")
    max_len, cpu = config.max_position_embeddings, torch.device("cpu")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    positions = torch.arange(max_len, dtype=torch.float, device=cpu)
    if rope_type == "default":
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float, device=cpu) / config.head_dim
        table = _cos_sin(positions, 1.0 / (params["rope_theta"] ** exponents), 1.0)
    elif rope_type == "dynamic":
        table = _dynamic_ntk_table(hf, max_len, kwargs)
    elif rope_type == "longrope":
        original_max = params["original_max_position_embeddings"]
        short_inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](hf, cpu, **kwargs)
        long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, cpu, seq_len=original_max + 1, **kwargs)
        table = torch.cat(
            (_cos_sin(positions, long_inv_freq, scaling), _cos_sin(positions[:original_max], short_inv_freq, scaling))
        )
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, cpu, **kwargs)
        table = _cos_sin(positions, inv_freq, scaling)
    return table.to(torch.get_default_device())


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    freqs = positions[:, None] * inv_freq.float().cpu()[None, :]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


def _dynamic_ntk_table(hf: object, max_len: int, kwargs: dict[str, str]) -> torch.Tensor:
    """Rows up to the checkpoint's max_position_embeddings from its own frequencies (transformers' init), each later
    row p from the frequencies transformers computes for a sequence of p + 1 tokens (a tensor length, as its
    `dynamic_rope_update` passes it)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS["dynamic"]
    cpu = torch.device("cpu")
    trained = min(max_len, hf.max_position_embeddings)  # type: ignore[attr-defined]
    inv_freq, scaling = init(hf, cpu, **kwargs)
    rows = [_cos_sin(torch.arange(trained, dtype=torch.float), inv_freq, scaling)]
    for position in range(trained, max_len):
        inv_freq, scaling = init(hf, cpu, seq_len=torch.tensor(position + 1), **kwargs)
        rows.append(_cos_sin(torch.tensor([float(position)]), inv_freq, scaling))
    return torch.cat(rows)


def rope_table_rows(config: ModelConfig, positions: np.ndarray, max_lengths: np.ndarray) -> np.ndarray:
    """The table row each token reads: its position, except under LongRoPE for a sequence that fits
    original_max_position_embeddings: the short factors' row. positions and max_lengths [T] int64 (max_lengths: the
    token's sequence's prompt + max_tokens). Positions past it (a verify row's drafts past max_tokens, thrown away)
    read the long rows: the short set has no row there."""
    short_until = config.rope_short_until
    if short_until is None:
        return positions
    short = (max_lengths <= short_until) & (positions < short_until)
    return positions + short * config.max_position_embeddings


def rope_cache_namespace(config: ModelConfig, max_length: int) -> bytes:
    """The prefix-cache namespace (Request.cache_namespace) of a sequence of at most `max_length` tokens (prompt +
    max_tokens): under LongRoPE one that reads the short rows holds other K/V than one over the same tokens that
    reads the long rows."""
    if config.rope_short_until is not None and max_length <= config.rope_short_until:
        return b"longrope-short"
    return b""
