"""Engine and model configuration: what the user asks for, and what a checkpoint folder says."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedq.engine.config.architectures import check_supported
from pagedq.engine.config.moe import MoeConfig
from pagedq.engine.options import EngineOptions

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope", "dynamic")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # transformers' layer_types values
# The gated MLP's activation (config.json's hidden_act; transformers' Gemma classes read hidden_activation) by
# architecture; the rest take silu.
GATED_ACTIVATIONS = {"Gemma2ForCausalLM": "gelu_pytorch_tanh", "Gemma3ForCausalLM": "gelu_pytorch_tanh"}
# None: per device, ASYNC_SCHEDULING_BY_DEVICE; the tests set it for every engine (PAGEDQ_TEST_SCHEDULING,
# tests/conftest.py).
DEFAULT_ASYNC_SCHEDULING: bool | None = None
# On CUDA the host's work hides behind the device's; on CPU the "device" is a thread on the same cores, and the
# overlap still paid in interleaved runs (docs/benchmarks.md#async-scheduling).
ASYNC_SCHEDULING_BY_DEVICE = {"cuda": True, "cpu": True}
# Said wherever a model path is not a checkpoint: a hub id like meta-llama/Llama-3.2-1B looks like a path here.
LOCAL_CHECKPOINTS_ONLY = (
    "pagedq loads local checkpoint folders only; no model hub is reachable: download it elsewhere and pass the folder"
)
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "half": torch.float16,
}

# LoRA bounds. Slots are pre-allocated at max_lora_rank for every adapted linear of every layer: at 256 an 8B model's
# 8 slots take gigabytes, and an adapter of higher rank is better merged into its base. Slots are read per step by
# every adapted linear; the host cache holds whole adapters in memory.
MAX_LORA_RANK = 256
MAX_LORAS = 64
MAX_CPU_LORAS = 4096


@dataclass
class EngineConfig(EngineOptions):
    """Knobs of one engine instance: the fields (defaults and help) are EngineOptions' (pagedq/engine/options.py,
    torch-free, where the CLIs derive their flags from); this adds the checkpoint and validates."""

    model: str = field(kw_only=True)
    # a torch.dtype once resolved (EngineOptions, torch-free, can only say str)
    dtype: str | torch.dtype = EngineOptions.dtype  # type: ignore[assignment]
    # JSON text, a dict or a SpeculativeConfig; a SpeculativeConfig (or None) once parsed
    speculative_config: Any = EngineOptions.speculative_config

    def __post_init__(self) -> None:
        self.device = resolve_device(self.device)
        if self.async_scheduling is None:
            self.async_scheduling = DEFAULT_ASYNC_SCHEDULING
        if self.async_scheduling is None:
            self.async_scheduling = ASYNC_SCHEDULING_BY_DEVICE["cuda" if self.device.startswith("cuda") else "cpu"]
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer or None, got {self.num_kv_blocks!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if not self.swap_space_gib > 0:
            raise ValueError(f"swap_space_gib must be > 0, got {self.swap_space_gib!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        self._check_lora()
        self.dtype = resolve_dtype(self.dtype, self.device)
        if self.speculative_config is not None:  # ValueError naming the bad key
            from pagedq.engine.config.speculative import SpeculativeConfig

            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        bounds = {"max_loras": MAX_LORAS, "max_lora_rank": MAX_LORA_RANK, "max_cpu_loras": MAX_CPU_LORAS}
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        for name, highest in bounds.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= highest:
                raise ValueError(f"{name} must be an integer in [1, {highest}], got {value!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")


def resolve_device(device: str | torch.device) -> str:
    device = str(device)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """'auto' means bf16 on CUDA and fp32 on CPU (CPU bf16 matmuls are slow and inexact)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


@dataclass
class ModelConfig:
    """The architecture facts our model code needs, read from a Hugging Face config.json."""

    architecture: str
    hf_config: object = field(repr=False)
    vocab_size: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False
    o_proj_bias: bool = False  # config.attention_bias: a bias on o_proj as on q/k/v (gpt-oss; Llama when set)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    eos_token_ids: tuple[int, ...] = ()
    # LongRoPE's original_max_position_embeddings: a sequence whose prompt + max_tokens fits it reads the short
    # factors (pagedq/engine/layers/rotary.py); None for every other RoPE type
    rope_short_until: int | None = None
    # the expert facts of a mixture-of-experts architecture (pagedq/engine/layers/moe.py); None for a dense one
    moe: MoeConfig | None = None
    # Attention variants (wt-attn). layer_types: per layer "full_attention" | "sliding_attention"; a sliding layer's
    # query sees the sliding_window keys up to and including its own (pagedq/kernels/reference.py window_start).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit in every softmax's denominator
    # Gemma 2 / Gemma 3 (pagedq/engine/models/gemma.py)
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 when set, else head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) when set
    rms_norm_unit_offset: bool = False  # RMSNorm weights are stored minus 1: norms scale by (1 + weight)

    def layer_window(self, layer_idx: int) -> int:
        """Layer layer_idx's sliding window for the attention kernels: 0 (full attention) unless it slides."""
        if self.layer_types and self.layer_types[layer_idx] == SLIDING_ATTENTION and self.sliding_window:
            return self.sliding_window
        return 0

    @property
    def every_layer_slides(self) -> bool:
        """Whether every layer attends through the same sliding window (then blocks before it can be freed)."""
        return bool(self.sliding_window) and all(kind == SLIDING_ATTENTION for kind in self.layer_types)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ModelConfig:
        from transformers import AutoConfig

        folder = Path(folder)
        if not (folder / "config.json").is_file():
            what = "no config.json in it" if folder.is_dir() else "a file" if folder.exists() else "no such folder"
            raise FileNotFoundError(f"{folder} is not a checkpoint folder ({what}); {LOCAL_CHECKPOINTS_ONLY}")
        hf = AutoConfig.from_pretrained(folder)
        architecture = (getattr(hf, "architectures", None) or ["?"])[0]
        check_supported(architecture)
        check_checkpoint_options(hf)
        hidden_act = _hidden_act(architecture, hf)
        num_heads = hf.num_attention_heads
        rope = rope_parameters_of(hf)
        layer_types, sliding_window, softcap = _attention_variants(hf)
        gemma = _gemma_fields(architecture, hf)  # checked before any weight loads, as the options above
        if architecture == "Gemma3ForCausalLM":
            softcap = None  # transformers' Gemma 3 attention applies none, whatever its config says
        return cls(
            architecture=architecture,
            hf_config=hf,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            rms_norm_eps=hf.rms_norm_eps,
            qkv_bias=architecture == "Qwen2ForCausalLM"
            or bool(getattr(hf, "attention_bias", False))
            or (architecture == "Qwen2MoeForCausalLM" and bool(getattr(hf, "qkv_bias", True))),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            o_proj_bias=bool(getattr(hf, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=_rope_max_len(hf),
            eos_token_ids=_eos_token_ids(folder, hf),
            rope_short_until=rope["original_max_position_embeddings"] if rope.get("rope_type") == "longrope" else None,
            layer_types=layer_types,
            sliding_window=sliding_window,
            attn_logit_softcapping=softcap,
            attention_sinks=hf.model_type == "gpt_oss",
            hidden_act=hidden_act,
            **gemma,
            moe=MoeConfig.from_hf(architecture, hf),
        )


# ---- what a checkpoint may ask for (one error naming the option, before any weight loads) ------------------------


def rope_parameters_of(hf: object, layer_type: str | None = None) -> dict[str, Any]:
    """The checkpoint's RoPE settings (transformers 5 normalizes old `rope_scaling` into `rope_parameters`); with
    `layer_type`, that layer type's entry of a per-layer-type dict."""
    params = getattr(hf, "rope_parameters", None) or {}
    return dict(params[layer_type] if layer_type is not None else params)


def check_checkpoint_options(hf: object) -> None:
    """ValueError naming the first option of config.json pagedq does not serve, and what it serves instead."""
    quantization = getattr(hf, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else type(quantization)
        raise ValueError(
            f"unsupported quantization_config (quant_method {method!r}): pagedq serves unquantized weights only "
            "(float32, float16 or bfloat16 checkpoints)"
            + (
                "; dequantize it first (transformers: Mxfp4Config(dequantize=True), then save_pretrained)"
                if method == "mxfp4"
                else ""
            )
        )
    for rope in _rope_parameter_sets(hf):
        rope_type = rope.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
        if partial is not None and partial != 1.0:
            raise ValueError(f"unsupported partial_rotary_factor {partial!r}: pagedq rotates the whole head (1.0 only)")
    _hidden_act((getattr(hf, "architectures", None) or ["?"])[0], hf)
    if getattr(hf, "mlp_bias", False):
        raise ValueError("unsupported mlp_bias true: pagedq's MLP projections have no bias")


def _rope_parameter_sets(hf: object) -> list[dict[str, Any]]:
    """Each RoPE table's settings: one per layer type where rope_parameters holds one dict per layer type (Gemma 3),
    else the model's single one."""
    per_layer_type = [kind for kind in (FULL_ATTENTION, SLIDING_ATTENTION) if kind in rope_parameters_of(hf)]
    return [rope_parameters_of(hf, kind) for kind in per_layer_type] or [rope_parameters_of(hf)]


def _rope_max_len(hf) -> int:
    """Longest context the RoPE settings serve, as vLLM derives it: YaRN's original_max_position_embeddings * factor,
    dynamic NTK's max_position_embeddings * factor; the checkpoint's max_position_embeddings otherwise."""
    rope = rope_parameters_of(hf)
    rope_type, factor = rope.get("rope_type", "default"), rope.get("factor")
    if rope_type == "yarn" and factor:
        return int(rope.get("original_max_position_embeddings", hf.max_position_embeddings) * factor)
    if rope_type == "dynamic":
        return int(hf.max_position_embeddings * factor)
    return hf.max_position_embeddings


def _attention_variants(hf) -> tuple[tuple[str, ...], int | None, float | None]:
    """(layer_types, sliding_window, attn_logit_softcapping) from an HF config: the per-layer types where the config
    has them (transformers 5 derives them for Qwen2 from use_sliding_window and max_window_layers, and Gemma 2/3 and
    gpt-oss write them), else every layer sliding when sliding_window is set (Mistral), else full."""
    window = getattr(hf, "sliding_window", None)
    if window == 0 and not isinstance(window, bool):  # transformers' Qwen2-MoE config writes 0 for "no window"
        window = None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"sliding_window must be a positive integer, 0 or null, got {window!r}")
    kinds = getattr(hf, "layer_types", None)
    if kinds is None:
        kinds = [SLIDING_ATTENTION if window else FULL_ATTENTION] * hf.num_hidden_layers
    kinds = tuple(kinds)
    if len(kinds) != hf.num_hidden_layers or not set(kinds) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ValueError(
            f"layer_types must name {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r} for each of the "
            f"{hf.num_hidden_layers} layers, got {list(kinds)}"
        )
    if SLIDING_ATTENTION in kinds and not window:
        raise ValueError("layer_types has sliding_attention layers but the config sets no sliding_window")
    softcap = getattr(hf, "attn_logit_softcapping", None)
    if softcap is not None and not (isinstance(softcap, (int, float)) and 0 < softcap < float("inf")):
        raise ValueError(f"attn_logit_softcapping must be a positive number or null, got {softcap!r}")
    return kinds, window if SLIDING_ATTENTION in kinds else None, None if softcap is None else float(softcap)


def _hidden_act(architecture: str, hf) -> str:
    """The gated MLP's activation, from the field transformers' class for `architecture` reads; ValueError if we do
    not serve it (transformers' Gemma classes read hidden_activation, and ignore the hidden_act a Gemma config.json
    also carries)."""
    expected = GATED_ACTIVATIONS.get(architecture, "silu")
    name = "hidden_activation" if architecture in GATED_ACTIVATIONS else "hidden_act"
    act = getattr(hf, name, None) or expected
    if act != expected:
        raise ValueError(f"unsupported {name} {act!r}; supported: {expected} (for {architecture})")
    return act


def _gemma_fields(architecture: str, hf) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma config (none for other families), checked."""
    if architecture not in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return {}
    if getattr(hf, "use_bidirectional_attention", None):
        raise ValueError(f"{architecture} with use_bidirectional_attention (an embedding model) is not supported")
    fields = {"query_pre_attn_scalar": hf.query_pre_attn_scalar, "final_logit_softcapping": hf.final_logit_softcapping}
    for name, value in fields.items():
        required = name == "query_pre_attn_scalar"
        if (value is not None or required) and not (isinstance(value, (int, float)) and 0 < value <= 1e6):
            raise ValueError(
                f"{architecture}: {name} must be a number in (0, 1e6]{'' if required else ' or null'}, got {value!r}"
            )
    return {
        "rms_norm_unit_offset": True,
        **{name: None if value is None else float(value) for name, value in fields.items()},
    }


def _eos_token_ids(folder: Path, hf) -> tuple[int, ...]:
    """EOS ids from generation_config.json (may be a list, and may differ from config.json), else config.json."""
    ids = None
    gen = folder / "generation_config.json"
    if gen.is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = getattr(hf, "eos_token_id", None)
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)
