"""Random-weight PEFT adapter folders for the LoRA front-door tests (issue 36), written with peft itself."""

from __future__ import annotations

from pathlib import Path

TARGETS = ("q_proj", "v_proj", "down_proj")


def write_adapter(base: Path, folder: Path, seed: int, rank: int = 4, hidden_size: int | None = None) -> Path:
    """A PEFT LoRA folder for the checkpoint `base`: non-zero A and B (init_lora_weights=False), so it changes the
    model's output. hidden_size: made instead for a model like `base` of that width (another base model)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    if hidden_size is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
    else:
        other = transformers.AutoConfig.from_pretrained(base)
        other.hidden_size, other.intermediate_size = hidden_size, 2 * hidden_size
        other.head_dim = hidden_size // other.num_attention_heads
        model = transformers.AutoModelForCausalLM.from_config(other)
    config = LoraConfig(r=rank, lora_alpha=16, target_modules=list(TARGETS), init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(folder)
    return folder
