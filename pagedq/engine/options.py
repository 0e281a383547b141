"""The engine knobs a user sets, with their help text: the one source of every engine flag.

Torch-free on purpose: `pagedq worker/status/dlq --help` build their parsers from this module on machines
without torch. `EngineConfig` (pagedq/engine/config/engine.py) inherits these fields and validates them; the CLIs
(pagedq/engine/cli.py here, pagedq/worker/cli/main.py through its pydantic settings model) derive their flags from
`engine_options()`.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


def knob(default: object, help: str, choices: tuple[str, ...] | None = None, negatable: bool = False) -> Any:
    """A dataclass field whose metadata carries its flag's help (and choices; negatable: --x/--no-x)."""
    return field(default=default, metadata={"help": help, "choices": choices, "negatable": negatable})


@dataclass
class EngineOptions:
    """Knobs of one engine instance; names and defaults follow vLLM."""

    dtype: str = knob("auto", "auto (bf16 on CUDA, fp32 on CPU), float16, bfloat16 or float32")
    device: str = knob("auto", "auto (cuda if present), cpu, cuda or cuda:N")
    block_size: int = knob(16, "tokens per KV cache block")
    num_kv_blocks: int | None = knob(
        None, "KV cache blocks (default: sized from --gpu-memory-utilization on CUDA, from --cpu-kv-cache-gib on CPU)"
    )
    gpu_memory_utilization: float = knob(0.9, "fraction of GPU memory the engine may use, KV cache included")
    max_num_seqs: int = knob(256, "sequences running at once at most")
    max_num_batched_tokens: int = knob(8192, "tokens per engine step at most: the prefill chunk budget")
    max_model_len: int | None = knob(None, "longest prompt + output served (default: the checkpoint's)")
    seed: int = knob(0, "seed of the engine's sampling")
    cpu_kv_cache_gib: float = knob(
        1.0,
        "KV cache size on CPU when --num-kv-blocks is not given (GiB); mapped lazily, so resident memory grows "
        "with the blocks written, up to this",
    )
    enable_prefix_caching: bool = knob(True, "reuse the KV blocks of a shared prompt prefix", negatable=True)
    preemption_mode: str = knob(
        "recompute",
        "what a preempted sequence's blocks become: recomputed later, or swapped to a CPU pool and back",
        choices=("recompute", "swap"),
    )
    # Seat preemption (core/seats.py): a waiting request of higher priority takes a running lower one's seat
    seat_preemption_interval: int = knob(
        4, "steps a sequence keeps its seat before a higher-priority request may take it (0: never)"
    )
    max_seat_preemptions: int = knob(2, "times one sequence may lose its seat to higher-priority requests")
    swap_space_gib: float = knob(4.0, "size of the CPU swap pool of --preemption-mode swap (GiB)")
    enforce_eager: bool = knob(False, "no CUDA graphs for decode steps")
    # Schedule and prepare step t+1 while step t runs on the device (step/async_step.py); outputs are identical
    # either way. None: DEFAULT_ASYNC_SCHEDULING, else ASYNC_SCHEDULING_BY_DEVICE (pagedq/engine/config/engine.py).
    async_scheduling: bool | None = knob(
        None, "schedule step t+1 while step t runs (default: on; on CPU as measured, docs/engine.md)", negatable=True
    )
    speculative_config: str | None = knob(
        None,
        'speculative decoding, as JSON with vLLM\'s names: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (default: off)',
    )
    structured_outputs_compile_timeout_s: float = knob(
        10.0, "a structured_outputs grammar not compiled within this many seconds fails its request"
    )
    structured_outputs_cache_mib: float = knob(256.0, "memory for compiled structured_outputs grammars (MiB)")
    # LoRA adapters per request (pagedq/engine/lora/; docs/engine.md#lora-adapters). Defaults: vLLM's rank (16)
    # and SGLang's adapters per batch (8: vLLM's 1 would serialise a batch mixing adapters).
    enable_lora: bool = knob(False, "serve LoRA adapters named per request (PEFT folders)")
    max_loras: int = knob(8, "LoRA adapters in one batch at most: the device slots, pre-allocated at --max-lora-rank")
    max_lora_rank: int = knob(16, "highest LoRA rank served (1-256): every slot is pre-allocated at this rank")
    max_cpu_loras: int | None = knob(
        None,
        "LoRA adapters kept loaded on the host, least recently used dropped first (>= --max-loras; default: "
        "--max-loras)",
    )


@dataclass(frozen=True)
class EngineOption:
    """One knob as a CLI sees it: name (the EngineConfig keyword), Python type, default, help, choices."""

    name: str
    type: type
    default: object
    help: str
    choices: tuple[str, ...] | None
    negatable: bool

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def optional(self) -> bool:
        return self.default is None


def value_type(hint: object) -> type:
    """int for `int` and `int | None`: the type a flag's text converts to."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    found = args[0] if args else hint
    if not isinstance(found, type):
        raise TypeError(f"a flag needs a plain type or one `| None`, got {hint!r}")
    return found


def engine_options(exclude: Iterable[str] = ()) -> tuple[EngineOption, ...]:
    skip = set(exclude)
    hints = typing.get_type_hints(EngineOptions)
    return tuple(
        EngineOption(
            f.name,
            value_type(hints[f.name]),
            f.default,
            f.metadata["help"],
            f.metadata["choices"],
            f.metadata["negatable"],
        )
        for f in dataclasses.fields(EngineOptions)
        if f.name not in skip
    )


def flag_help(option: EngineOption) -> str:
    text = option.help if option.default is None else f"{option.help} (default {option.default})"
    return text.replace("%", "%%")


def add_engine_arguments(parser: argparse.ArgumentParser, exclude: Iterable[str] = ()) -> None:
    """Every engine flag (except `exclude`), defaults from EngineOptions; EngineConfig validates the values."""
    for option in engine_options(exclude):
        if option.type is bool:
            action = argparse.BooleanOptionalAction if option.negatable else "store_true"
            parser.add_argument(option.flag, action=action, default=option.default, help=flag_help(option))
        else:
            parser.add_argument(
                option.flag, type=option.type, default=option.default, choices=option.choices, help=flag_help(option)
            )


def engine_kwargs_from(args: argparse.Namespace, exclude: Iterable[str] = ()) -> dict[str, object]:
    """The EngineConfig keywords in parsed arguments (those add_engine_arguments added, less `exclude`)."""
    return {o.name: getattr(args, o.name) for o in engine_options(exclude) if hasattr(args, o.name)}
