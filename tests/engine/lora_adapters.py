"""Random-weight PEFT LoRA folders written by the tests (peft is the oracle, never the engine's dependency)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL = ATTENTION + MLP


def write_adapter(
    checkpoint: Path,
    folder: Path,
    targets: tuple[str, ...] = ALL,
    rank: int = 8,
    alpha: float = 16.0,
    use_rslora: bool = False,
    seed: int = 0,
    **options: object,
) -> Path:
    """A PEFT LoRA adapter of the checkpoint, its A and B both random (init_lora_weights=False: B is not zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=use_rslora,
        target_modules=list(targets),
        init_lora_weights=False,
        **options,
    )
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():  # PEFT's own random init of B is small; make each adapter move the greedy tokens
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    model.save_pretrained(folder)
    return folder


def peft_model(checkpoint: Path, adapter: Path):
    """transformers + PEFT's PeftModel on the adapter, fp32, eval mode: the oracle."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter).eval()


def edit_config(adapter: Path, **changes: object) -> Path:
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return adapter


def write_random_adapter(
    checkpoint: Path, folder: Path, targets: tuple[str, ...] = ALL, rank: int = 8, alpha: float = 16.0, seed: int = 0
) -> Path:
    """A PEFT-format LoRA folder of random A and B written with safetensors alone (for machines without peft,
    where the oracle is another engine path, not PeftModel)."""
    from safetensors.torch import save_file

    config = json.loads((checkpoint / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            parent = "self_attn" if target in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{target}"
            in_features, out_features = shapes[target]
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.2
            weights[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.2
    folder.mkdir(parents=True)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets)}
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    return folder
