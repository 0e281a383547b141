"""PEFT LoRA folders read with json + safetensors (the engine never imports peft; PEFT is the tests' oracle).

A folder holds adapter_config.json and adapter_model.safetensors (or adapter_model.bin). Its weights are
`base_model.model.<module path>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]; the adapter adds
`x @ A^T @ B^T * scaling` to each target's output, scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).
Loading folds the scaling into B, checks every option the engine cannot serve and every shape against the served
model, and raises one `LoRALoadError` naming the problem before anything reaches a device.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# The projections an adapter may target (PEFT's names of the checkpoint's modules); lm_head and the embeddings
# are not adapted.
TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_WEIGHT = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes


class LoRALoadError(ValueError):
    """An adapter the engine cannot serve: the message names the adapter and the problem."""


@dataclass(frozen=True)
class ModelTargets:
    """What an adapter may adapt in the served model: each target projection's (in, out) features, and its layers."""

    shapes: Mapping[str, tuple[int, int]]
    num_layers: int


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter read from disk, on the host: per (layer, projection) A [r, in] and B [out, r] with the scaling
    folded into B. `key` is its load identity (distinct for every load, even of the same name), which slots and
    the prefix cache are keyed by."""

    key: int
    name: str
    path: str
    rank: int
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(key: int, name: str, path: str, targets: ModelTargets, max_rank: int) -> LoRAAdapter:
    folder = Path(path)

    def fail(problem: str) -> LoRALoadError:
        return LoRALoadError(f"LoRA adapter {name!r} ({path}): {problem}")

    if not folder.is_dir():
        raise fail("no such folder" if not folder.exists() else "not a folder")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise fail(f"no {CONFIG_FILE} in it")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise fail(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise fail(f"{CONFIG_FILE} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise fail(f"{CONFIG_FILE} must hold a JSON object")
    rank, scaling = _check_config(config, targets, max_rank, fail)
    weights = _read_weights(folder, fail)
    modules = _pair_weights(weights, rank, targets, fail)
    folded = {where: (a.contiguous(), (b * scaling).contiguous()) for where, (a, b) in modules.items()}
    return LoRAAdapter(key, name, str(path), rank, folded)


def _check_config(config: dict, targets: ModelTargets, max_rank: int, fail) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoRA config, or the error of the first option the engine cannot serve."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail(f"peft_type is {peft_type!r}; only LORA adapters are served")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise fail(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise fail(f"rank {rank} exceeds max_lora_rank {max_rank} (start the engine with --max-lora-rank {rank})")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha < 1e6:
        raise fail(f"lora_alpha must be a positive number, got {alpha!r}")
    unsupported = {
        "use_dora": (bool(config.get("use_dora")), "DoRA (use_dora) is not supported"),
        "bias": (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} is not supported, only 'none'"),
        "lora_bias": (bool(config.get("lora_bias")), "lora_bias is not supported"),
        "modules_to_save": (bool(config.get("modules_to_save")), "modules_to_save is not supported"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D models) is not supported"),
        "rank_pattern": (bool(config.get("rank_pattern")), "rank_pattern (per-module ranks) is not supported"),
        "alpha_pattern": (bool(config.get("alpha_pattern")), "alpha_pattern (per-module alphas) is not supported"),
        "trainable_token_indices": (bool(config.get("trainable_token_indices")), "trainable tokens are not supported"),
    }
    for _, (present, problem) in unsupported.items():
        if present:
            raise fail(problem)
    target_modules = config.get("target_modules")
    if isinstance(target_modules, list):
        for target in target_modules:
            leaf = str(target).rsplit(".", 1)[-1]
            if leaf not in TARGET_NAMES:
                raise fail(f"target module {target!r} is not one the engine adapts ({', '.join(TARGET_NAMES)})")
            if leaf not in targets.shapes:
                raise fail(f"target module {target!r}: the served model has no {leaf}")
    elif target_modules is not None and not isinstance(target_modules, str):  # a str: a regex or "all-linear"
        raise fail(f"target_modules must be a list or a string, got {type(target_modules).__name__}")
    layers = config.get("layers_to_transform")
    if layers is not None:
        for layer in [layers] if isinstance(layers, int) else layers:
            if not isinstance(layer, int) or not 0 <= layer < targets.num_layers:
                raise fail(f"layers_to_transform names layer {layer!r}; the served model has {targets.num_layers}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _read_weights(folder: Path, fail) -> dict[str, torch.Tensor]:
    for file_name in WEIGHT_FILES:
        path = folder / file_name
        if not path.is_file():
            continue
        try:
            if file_name.endswith(".safetensors"):
                from safetensors.torch import load_file

                loaded = load_file(str(path))
            else:
                loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # a corrupt or truncated file: any reader error is the adapter's fault
            raise fail(f"cannot read {file_name} ({type(error).__name__}: {error})") from None
        if not isinstance(loaded, dict):
            raise fail(f"{file_name} does not hold a state dict")
        return {str(k): v.to(torch.float32) for k, v in loaded.items()}
    raise fail(f"no weights in it ({' or '.join(WEIGHT_FILES)})")


def _pair_weights(
    weights: dict[str, torch.Tensor], rank: int, targets: ModelTargets, fail
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _WEIGHT.fullmatch(key)
        if match is None:
            raise fail(
                f"weight {key!r} is not a LoRA A/B matrix of a layer's projection (embeddings, lm_head, "
                "DoRA magnitudes and biases are not supported)"
            )
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in TARGET_NAMES or module not in targets.shapes:
            raise fail(f"weight {key!r} targets {module}, which the served model does not have")
        if layer >= targets.num_layers:
            raise fail(
                f"weight {key!r} is for layer {layer}; the served model has {targets.num_layers} layers "
                "(an adapter of another base model)"
            )
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise fail("its weights hold no LoRA matrices")
    pairs = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise fail(f"layer {layer} {module} has lora_{''.join(pair)} but not its other half")
        a, b = pair["A"], pair["B"]
        in_features, out_features = targets.shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise fail(
                f"layer {layer} {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not of rank {rank}"
            )
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise fail(
                f"layer {layer} {module}: lora_A {list(a.shape)}, lora_B {list(b.shape)} do not fit the served "
                f"model's {module} ({in_features} in, {out_features} out): an adapter of another base model"
            )
        pairs[(layer, module)] = (a, b)
    return pairs
