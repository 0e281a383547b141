"""Which model class serves which checkpoint architecture (config.json's `architectures[0]`).

Adding an architecture: write its model file in pagedq/engine/models/ (composing pagedq/engine/layers/) and add one line
to pagedq/engine/config/architectures.py. Classes are imported only when a model is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagedq.engine.config.architectures import ARCHITECTURES, check_supported, supported_architectures

if TYPE_CHECKING:  # for the annotation only: the table stays readable without model code
    from pagedq.engine.models.llama import LlamaForCausalLM

# the table itself (not a copy): registering an architecture here is seen by the config's check too
_MODELS = ARCHITECTURES
__all__ = ["check_supported", "model_class", "supported_architectures"]


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class to build for `architecture` (every architecture here runs on the Llama module tree; a family
    that does not would make this return a Protocol of what the runner calls)."""
    check_supported(architecture)
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
