"""Flags of `bench throughput` and `bench host`, apart from the benches themselves (which import torch), so that
building the `pagedq` parser stays torch-free."""

from __future__ import annotations

import argparse
from typing import TypedDict

from pagedq.engine.config.speculative import SpeculativeConfig
from pagedq.engine.options import add_engine_arguments

# bench throughput flags that shadow an engine knob: --seed seeds the workload here, and --speculative-config is
# run next to no speculation (pagedq/bench/engine/speculative.py)
OWN_FLAGS = ("seed", "speculative_config")
GROUNDED = "grounded"  # the input-grounded workload of pagedq/bench/engine/grounded.py (a real model, real text)
# The benches' speculative config when none is given (bench ngram)
DEFAULT_SPECULATIVE_CONFIG = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
)
GROUNDED_BATCH_SIZES = [1, 4, 16, 64]


# Reference workloads (shared/anchors/README.md): Llama-3.2-1B and Llama-3-8B shapes, random weights.
class WorkloadSpec(TypedDict):
    shape: dict[str, float]  # config.json fields of a model shape (ints and bools are floats to a type checker)
    num_prompts: int


class MoeWorkloadSpec(WorkloadSpec):
    model_type: str  # transformers' model type the shape is a config of (the Llama ones have none: "llama")


WORKLOADS: dict[str, WorkloadSpec] = {
    "W1": {
        "shape": dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=4096,
            rope_theta=500000.0,
            tie_word_embeddings=True,
        ),
        "num_prompts": 256,
    },
    "W8": {
        "shape": dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=4096,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
        "num_prompts": 128,
    },
}
# Mixture-of-experts shapes, random weights (docs/benchmarks.md#mixture-of-experts). MOE-S: a small Qwen3-MoE
# (8 experts, top-2) for the CPU; MOE-M: a Qwen3-MoE-like shape for a GPU (32 experts, top-4, hidden 1024).
MOE_WORKLOADS: dict[str, MoeWorkloadSpec] = {
    "MOE-S": {
        "model_type": "qwen3_moe",
        "shape": dict(
            hidden_size=512,
            intermediate_size=1024,
            moe_intermediate_size=512,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=8192,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
        "num_prompts": 32,
    },
    "MOE-M": {
        "model_type": "qwen3_moe",
        "shape": dict(
            hidden_size=1024,
            intermediate_size=3072,
            moe_intermediate_size=512,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=32000,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
        "num_prompts": 64,
    },
    # gpt-oss on a GPU (wt-gptoss): gpt-oss-20b's attention (64 heads of 64, 8 KV heads, sinks, window 128 on every
    # other layer as GptOssConfig alternates them, YaRN) and routing (32 experts, top-4, biases, clamped SwiGLU), at a
    # fraction of its width and depth
    "GPTOSS-M": {
        "model_type": "gpt_oss",
        "shape": dict(
            hidden_size=1024,
            intermediate_size=512,
            num_local_experts=32,
            num_experts_per_tok=4,
            num_hidden_layers=8,
            sliding_window=128,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=32000,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
        ),
        "num_prompts": 64,
    },
}


SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    "penalties": dict(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1),
    "json": dict(temperature=0.0),  # and --structured-fraction of the sequences under a JSON schema
}


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    low_value, high_value = int(low), int(high or low)
    if not 1 <= low_value <= high_value:
        raise argparse.ArgumentTypeError(f"expected A:B with 1 <= A <= B, got {text!r}")
    return low_value, high_value


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint folder (a folder with only config.json: random weights)")
    parser.add_argument(
        "--workload",
        choices=[*sorted(WORKLOADS), *sorted(MOE_WORKLOADS), GROUNDED],
        help="reference workload of shared/anchors, a mixture-of-experts shape (MOE-S: CPU, MOE-M and GPTOSS-M: "
        "GPU), or grounded: documents from Python's reference docs with rewrite / quote / extract instructions, in the "
        "model's chat template (default model: the demo model), run at each --batch-sizes",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="prompts to run (default: the workload's, else 64)"
    )
    parser.add_argument(
        "--input-len",
        type=_range,
        default=(128, 1024),
        metavar="A:B",
        help="prompt lengths, drawn uniformly from A..B (default 128:1024)",
    )
    parser.add_argument(
        "--output-len",
        type=_range,
        default=(64, 512),
        metavar="C:D",
        help="output lengths, drawn uniformly from C..D (default 64:512)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and lengths (default 0)")
    parser.add_argument(
        "--baseline",
        choices=["hf", "none"],
        default="none",
        help="hf: transformers' generate on the same prompts, in the same run (default none)",
    )
    parser.add_argument(
        "--hf-batch-size",
        type=_positive_list,
        default=[64],
        metavar="N[,N...]",
        help="batch size(s) of the hf baseline, one run and one ratio each (default 64)",
    )
    parser.add_argument(
        "--scheduling",
        choices=["default", "both"],
        default="default",
        help="both: run the engine with async scheduling on and then off and report each (default: as the "
        "engine flags say)",
    )
    parser.add_argument(
        "--step-parts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time one decode step of the workload's batch part by part, next to torch.mm on its matmul "
        "shapes (roofline_ms_per_step)",
    )
    parser.add_argument(
        "--sharing",
        choices=["n4", "prefix", "beam"],
        help="memory sharing on vs off: 4 samples per prompt, a shared system prompt, or the "
        "blocks beam search (width 4) shares",
    )
    parser.add_argument("--prefix-len", type=int, default=512, help="system prompt length for --sharing prefix")
    add_speculative_arguments(parser)
    add_engine_arguments(parser, exclude=OWN_FLAGS)


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM spells it: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_max": N, "prompt_lookup_min": M}; the bench runs each batch size with it and without',
    )
    parser.add_argument(
        "--batch-sizes",
        type=_positive_list,
        default=None,
        metavar="B[,B...]",
        help="run the workload at each batch size B: max_num_seqs = B, B x --requests-per-seat requests, at "
        f"least --num-prompts (default for --workload {GROUNDED}: "
        f"{','.join(map(str, GROUNDED_BATCH_SIZES))}, with 4 prompts)",
    )
    parser.add_argument(
        "--requests-per-seat",
        type=int,
        choices=range(1, 17),
        default=3,
        metavar="R",
        help="with --batch-sizes: B x R requests at batch B (or --num-prompts if more), so seats refill as "
        "requests finish and the run is not paced by its slowest request (1: B requests, all at once)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        choices=range(1, 9),
        default=2,
        metavar="P",
        help="with --batch-sizes and --speculative-config: P pairs of runs (off and on) per batch size, in ABBA "
        "order (off, on, on, off, ...; the next batch size starts the other way); the record has every run and "
        "the mean of the pairs' ratios (default 2; 1: one pair, the order alternating per batch size)",
    )
    parser.add_argument(
        "--hf-prompt-lookup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --baseline hf and --speculative-config: transformers' own prompt lookup "
        "(prompt_lookup_num_tokens) at batch 1 as well",
    )


def speculative_config(text: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_ngram_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-seqs", type=_positive, default=256, help="sequences proposing together (default 256)")
    parser.add_argument(
        "--history-len",
        type=_range,
        default=(1024, 3072),
        metavar="A:B",
        help="tokens of each history to start from, drawn uniformly from A..B (default 1024:3072)",
    )
    parser.add_argument("--steps", type=_positive, default=16, help="engine steps to run (default 16)")
    parser.add_argument("--vocab-size", type=_positive, default=49152, help="token ids drawn below this")
    parser.add_argument(
        "--copy-rate", type=float, default=0.5, help="fraction of stretches copied from earlier (default 0.5)"
    )
    parser.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=SpeculativeConfig.parse(DEFAULT_SPECULATIVE_CONFIG),
        metavar="JSON",
        help=f"the proposer's config (default {DEFAULT_SPECULATIVE_CONFIG})".replace("%", "%%"),
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the token streams (default 0)")


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-seqs", type=_positive, default=256, help="sequences decoding together (default 256)")
    parser.add_argument(
        "--sampling",
        choices=sorted(SAMPLINGS),
        default="greedy",
        help="greedy, sampling with penalties (more host work per step), or json (structured outputs)",
    )
    parser.add_argument(
        "--structured-fraction",
        type=float,
        default=1.0,
        help="--sampling json: the fraction of sequences under a JSON schema (default 1)",
    )
    parser.add_argument("--vocab-size", type=_positive, default=128256, help="vocabulary of the stand-in model")
    parser.add_argument(
        "--simulated-device-ms",
        type=float,
        default=2.0,
        help="milliseconds the stand-in device takes per step (default 2)",
    )
    parser.add_argument("--prompt-len", type=_positive, default=512, help="prompt tokens per sequence (default 512)")
    parser.add_argument("--output-len", type=_positive, default=64, help="tokens generated per sequence (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    parser.add_argument("--device", default="cpu", help="cpu (stand-in device) or cuda (the real model, --model)")
    parser.add_argument("--model", default=None, help="checkpoint folder, for --device cuda")
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default=None,
        help="for --device cuda instead of --model: a reference workload's model shape, random weights",
    )


def _positive_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
