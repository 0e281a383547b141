"""pagedq's inference engine: paged KV cache, continuous batching, Llama-family models.

Depends only on torch, triton, transformers, safetensors (and tokenizers, which transformers brings).
Names are resolved lazily, so producers that only need the plain types (SamplingParams, RequestOutput)
do not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "SamplingParams": "engine.sampling_params",
    "RequestOutputKind": "engine.sampling_params",
    "StructuredOutputsParams": "engine.structured.params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "BeamSearchParams": "engine.beam_search",
    "BeamSearchOutput": "engine.beam_search",
    "BeamSearchSequence": "engine.beam_search",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
