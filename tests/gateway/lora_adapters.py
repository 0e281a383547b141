"""Random-weight PEFT adapter folders for the LoRA front-door tests (issue 36), written with peft itself."""

from __future__ import annotations

from pathlib import Path

TARGETS = ("q_proj", "v_proj", "down_proj")


def write_adapter(base: Path, folder: Path, seed: int, rank: int = 4) -> Path:
    """A PEFT LoRA folder for the checkpoint `base`: non-zero A and B (init_lora_weights=False), so it changes the
    model's output."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(r=rank, lora_alpha=16, target_modules=list(TARGETS), init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(folder)
    return folder
