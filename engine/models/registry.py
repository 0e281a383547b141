"""Which model class serves which checkpoint architecture (config.json's `architectures[0]`).

Adding an architecture: write its model file in engine/models/ (composing engine/layers/) and add one line here.
Classes are imported only when a model is built, so reading this table needs no model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotation only: the table stays readable without model code
    from engine.models.llama import LlamaForCausalLM

# architecture name -> (module, class): Mistral, Qwen2 and Qwen3 share the Llama module tree (their differences,
# qkv bias and per-head q/k norm, are ModelConfig flags the shared layers read).
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(_MODELS)


def check_supported(architecture: str) -> None:
    """ValueError naming the supported architectures if `architecture` has no model class."""
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(_MODELS)}")


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class to build for `architecture` (every architecture here runs on the Llama module tree; a family
    that does not would make this return a Protocol of what the runner calls)."""
    check_supported(architecture)
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
