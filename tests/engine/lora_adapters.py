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
