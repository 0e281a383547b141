"""pagedq's inference engine: paged KV cache, continuous batching, Llama-family models.

Depends only on torch, triton, transformers, safetensors (and tokenizers, which transformers brings).
Names are resolved lazily, so producers that only need the plain types (SamplingParams, RequestOutput)
do not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "pagedq.engine.llm",
    "LLMEngine": "pagedq.engine.llm_engine",
    "RequestRejected": "pagedq.engine.errors",
    "LoRARequest": "pagedq.engine.lora.request",
    "SamplingParams": "pagedq.engine.sample.sampling_params",
    "RequestOutputKind": "pagedq.engine.sample.sampling_params",
    "StructuredOutputsParams": "pagedq.engine.structured_output.params",
    "RequestOutput": "pagedq.engine.output.outputs",
    "CompletionOutput": "pagedq.engine.output.outputs",
    "BeamSearchParams": "pagedq.engine.beam_search",
    "BeamSearchOutput": "pagedq.engine.beam_search",
    "BeamSearchSequence": "pagedq.engine.beam_search",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedq.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
