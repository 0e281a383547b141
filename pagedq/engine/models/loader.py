"""Build our model from a local Hugging Face checkpoint folder.

Weights come from *.safetensors (preferred) or pytorch_model*.bin. The checkpoint's separate q/k/v and
gate/up projections are copied into our packed matrices; a checkpoint that packs them already (Phi-3's qkv_proj and
gate_up_proj, in our order) is copied whole; a MoE checkpoint's per-expert matrices go into the stacked expert
tensors (pagedq/engine/layers/moe.py). A folder holding only config.json gets random
weights (for benchmarks of a model shape without its weights).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedq import kernels
from pagedq.engine.config.engine import ModelConfig
from pagedq.engine.layers import PackedLinear
from pagedq.engine.layers.moe import Experts
from pagedq.engine.layers.norm import GemmaRMSNorm
from pagedq.engine.models.registry import model_class

if TYPE_CHECKING:
    from pagedq.engine.models.llama import LlamaForCausalLM

# checkpoint projection name -> (our packed module name, shard index)
_PACKED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_PACKED_NAME = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
# One expert's projection: Qwen-MoE's mlp.experts.N.{gate,up,down}_proj, Mixtral's block_sparse_moe.experts.N.w1/w3/w2.
_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PROJECTIONS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}
# Every expert at once, as transformers 5 holds them in memory: gate_up_proj [E, 2I, H] (gate rows first), down_proj;
# gpt-oss's checkpoints (MoeConfig.interleaved_gate_up): gate_up_proj [E, H, 2I] with gate and up columns
# interleaved, down_proj [E, I, H], and their biases.
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias)$")
_STACKED_TARGETS = {
    "gate_up_proj": ("w13", ("gate", "up")),
    "down_proj": ("w2", ("down",)),
    "gate_up_proj_bias": ("w13_bias", ("gate_bias", "up_bias")),
    "down_proj_bias": ("w2_bias", ("down_bias",)),
}
# Mixtral's checkpoint calls the expert block block_sparse_moe, ours is mlp as the Qwen MoE checkpoints call it;
# gpt-oss's calls its router mlp.router, ours is mlp.gate.
_RENAMED = ((".block_sparse_moe.", ".mlp."), (".mlp.router.", ".mlp.gate."))


def load_model(folder: str | Path, config: ModelConfig, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    # Built on the target device: random init of a large shape on the CPU would take minutes.
    ops = kernels.bind(device)  # the backend is chosen here, once, for the model's lifetime
    with torch.device(device):
        model = model_class(config.architecture)(config, ops)
    files = _weight_files(Path(folder))
    if files:
        _load_weights(model, _iter_checkpoint(files))
    else:
        _init_random(model, seed=0)
    # RoPE tables stay fp32, as in transformers (Gemma 3 has two: cos_sin_cache and local_cos_sin_cache)
    rope_tables = {name: table for name, table in model.named_buffers() if name.endswith("cos_sin_cache")}
    model.to(dtype=dtype)
    for name, table in rope_tables.items():
        setattr(model, name, table)
    return model.eval()


def _weight_files(folder: Path) -> list[Path]:
    safetensors = sorted(folder.glob("*.safetensors"))
    return safetensors or sorted(folder.glob("pytorch_model*.bin"))


def _iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118  (safe_open handles have keys() but do not iterate)
                    yield name, handle.get_tensor(name)
        else:
            yield from torch.load(path, map_location="cpu", weights_only=True).items()


def _load_weights(model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for checkpoint_name, tensor in tensors:
        if _IGNORED.search(checkpoint_name):
            continue
        name = _our_name(checkpoint_name)
        expert = _EXPERT_NAME.match(name) or _STACKED_EXPERTS.match(name)
        if expert:
            interleaved = model.config.moe is not None and model.config.moe.interleaved_gate_up
            loaded |= _load_experts(modules.get(expert.group(1)), expert, checkpoint_name, tensor, interleaved)
            continue
        packed = _PACKED_NAME.match(name)
        if packed:
            prefix, proj, kind = packed.groups()
            module_name, shard = _PACKED_SHARDS[proj]
            module = modules.get(f"{prefix}.{module_name}")
            if not isinstance(module, PackedLinear) or getattr(module, kind) is None:
                raise ValueError(f"checkpoint tensor {name} has no place in the model")
            module.load_shard(kind, shard, tensor)
            loaded.add(f"{prefix}.{module_name}.{kind}#{shard}")
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {name} has no place in the model")
        if params[name].shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, model expects {tuple(params[name].shape)}"
            )
        params[name].data.copy_(tensor)
        loaded.add(name)
        module = modules.get(name.rpartition(".")[0])
        if isinstance(module, PackedLinear):  # a checkpoint that packs them too (Phi-3): every shard at once
            loaded.update(f"{name}#{i}" for i in range(len(module.shard_offsets) - 1))
    _check_complete(model, loaded)


def _our_name(checkpoint_name: str) -> str:
    for theirs, ours in _RENAMED:
        checkpoint_name = checkpoint_name.replace(theirs, ours)
    return checkpoint_name


def _load_experts(
    module: nn.Module | None, match: re.Match[str], checkpoint_name: str, tensor: torch.Tensor, interleaved: bool
) -> set[str]:
    """Copy one expert's projection, or every expert's stacked tensor, into `module`; the names it loaded."""
    if not isinstance(module, Experts):
        raise ValueError(f"checkpoint tensor {checkpoint_name} has no place in the model")
    prefix, which = match.group(1), match.groups()[-1]
    if match.re is _STACKED_EXPERTS:
        param_name, projections = _STACKED_TARGETS[which]
        param = getattr(module, param_name)
        if param is None:
            raise ValueError(f"checkpoint tensor {checkpoint_name} has no place in the model")
        if interleaved and tensor.dim() == param.dim():  # else the shape check below names it
            tensor = _from_interleaved_layout(which, tensor)
        if tensor.shape != param.shape:
            raise ValueError(
                f"checkpoint tensor {checkpoint_name} has shape {tuple(tensor.shape)}, "
                f"model expects {tuple(param.shape)}"
            )
        param.data.copy_(tensor)
        return {f"{prefix}.{e}.{p}" for e in range(module.num_experts) for p in projections}
    expert, projection = int(match.group(2)), _EXPERT_PROJECTIONS[which]
    try:
        module.load_expert(expert, projection, tensor)
    except ValueError as error:
        raise ValueError(f"checkpoint tensor {checkpoint_name}: {error}") from None
    return {f"{prefix}.{expert}.{projection}"}


def _from_interleaved_layout(which: str, tensor: torch.Tensor) -> torch.Tensor:
    """gpt-oss's stacked expert tensor in our layout: gate_up_proj [E, H, 2I] (column 2j gate j, 2j + 1 up j) ->
    [E, 2I, H] gate rows then up rows; its bias [E, 2I] likewise; down_proj [E, I, H] -> [E, H, I]."""
    if which == "down_proj_bias":
        return tensor
    if which == "down_proj":
        return tensor.transpose(1, 2)
    if which == "gate_up_proj":
        tensor = tensor.transpose(1, 2)  # [E, 2I, H], rows interleaved
    return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)


def _check_complete(model: LlamaForCausalLM, loaded: set[str]) -> None:
    missing = []
    for module_name, module in model.named_modules():
        if isinstance(module, Experts):
            missing += [
                f"{module_name}.{e}.{p}"
                for e in range(module.num_experts)
                for p in module.projections
                if f"{module_name}.{e}.{p}" not in loaded
            ]
            continue
        if getattr(module, "sinks", None) is not None and f"{module_name}.sinks" not in loaded:
            missing.append(f"{module_name}.sinks")
        for kind in ("weight", "bias"):
            if getattr(module, kind, None) is None or not isinstance(getattr(module, kind), torch.nn.Parameter):
                continue
            full = f"{module_name}.{kind}"
            if isinstance(module, PackedLinear):
                shards = len(module.shard_offsets) - 1
                missing += [f"{full}#{i}" for i in range(shards) if f"{full}#{i}" not in loaded]
            elif full not in loaded and not (full == "lm_head.weight" and model.config.tie_word_embeddings):
                missing.append(full)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


def _init_random(model: nn.Module, seed: int) -> None:
    """Random weights for a config-only folder: normal(0, 0.02) like transformers, norms at identity (weight 1, or
    0 where the norm scales by 1 + weight)."""
    modules = dict(model.named_modules())
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(0.0 if isinstance(modules[name.rpartition(".")[0]], GemmaRMSNorm) else 1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
