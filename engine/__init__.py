"""pagedq's inference engine: paged KV cache, continuous batching, Llama-family models.

Depends only on torch, triton, transformers, safetensors (and tokenizers, which transformers brings).
"""

from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput"]
