"""`pagedq bench throughput`: this engine against transformers' generate on the same seeded workload, same process.

The workload is random token ids with EOS ignored, so both systems generate exactly the drawn number of
tokens. `--workload W1|W8` rebuilds the reference workloads of shared/anchors (model shape with random
weights, identical request draws) so GPU figures compare with the baselines measured there.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch


# Reference workloads (shared/anchors/README.md): Llama-3.2-1B and Llama-3-8B shapes, random weights.
class WorkloadSpec(TypedDict):
    shape: dict[str, float]  # config.json fields of a model shape (ints and bools are floats to a type checker)
    num_prompts: int


WORKLOADS: dict[str, WorkloadSpec] = {
    "W1": {"shape": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096,
                         rope_theta=500000.0, tie_word_embeddings=True),
           "num_prompts": 256},
    "W8": {"shape": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096,
                         rope_theta=500000.0, tie_word_embeddings=False),
           "num_prompts": 128},
}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def draw_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                  seed: int = 0) -> Workload:
    """Per request, in order: prompt length, its tokens in [10, vocab-10), then output length (as the anchors)."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_prompts):
        length = rng.randint(*input_len)
        prompts.append([rng.randrange(10, vocab_size - 10) for _ in range(length)])
        outputs.append(rng.randint(*output_len))
    return Workload(prompts, outputs)


def _config_only_folder(shape: dict) -> Path:
    from transformers import LlamaConfig

    folder = Path(tempfile.mkdtemp(prefix="pagedq-shape-"))
    LlamaConfig(**shape, architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return folder


def run_engine(model_dir: str, workload: Workload, engine_kwargs: dict) -> dict:
    from engine import LLMEngine, RequestOutputKind, SamplingParams
    from engine.startup import freeze_startup_objects

    engine = LLMEngine(model_dir, **engine_kwargs)
    freeze_startup_objects()  # as the worker does: measure the engine as it serves
    _run_engine_once(engine, Workload(workload.prompts[:2], [4, 4]), RequestOutputKind, SamplingParams)  # warm-up
    engine.reset_step_stats()
    preemptions_before = engine.scheduler.num_preemptions
    _sync(engine.config.device)
    start = time.perf_counter()
    generated = _run_engine_once(engine, workload, RequestOutputKind, SamplingParams)
    _sync(engine.config.device)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return {"engine_seconds": seconds, "engine_output_tok_s": generated / seconds,
            "engine_generated_tokens": generated, "kv_slot_utilization": stats["mean_kv_slot_utilization"],
            "num_preemptions": stats["num_preemptions"] - preemptions_before,
            "num_kv_blocks": engine.num_total_blocks, "device": engine.config.device,
            "dtype": str(engine.config.dtype).removeprefix("torch."),
            "peak_memory_gb": _peak_memory_gb(engine.config.device),
            "num_steps": stats["num_steps"], "num_graph_steps": stats["num_graph_steps"],
            "graph_capture_s": engine.model_runner.graph_capture_seconds,
            **{key: stats[key] for key in ("schedule_ms_per_step", "execute_ms_per_step", "postprocess_ms_per_step")}}


def _run_engine_once(engine, workload: Workload, kinds, params_cls) -> int:
    for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.output_lens)):
        params = params_cls(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=kinds.FINAL_ONLY)
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            generated += len(output.outputs[0].token_ids)
    return generated


def run_hf(model_dir: str, workload: Workload, batch_size: int, device: str, dtype: torch.dtype) -> dict:
    """transformers generate in static batches, left-padded, each batch run to its longest output."""
    from transformers import AutoModelForCausalLM

    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if any(Path(model_dir).glob("*.safetensors")) or any(Path(model_dir).glob("pytorch_model*.bin")):
        # transformers types PreTrainedModel.to through a wrapper whose first parameter is the model, not the device
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    else:  # a config-only folder (a model shape): random weights, as the engine gets
        from transformers import AutoConfig

        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).to(dtype).eval()
    warm = torch.tensor([workload.prompts[0][:8]], device=device)
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False, pad_token_id=0)
    _sync(device)
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[i:i + batch_size]
        longest_out = max(workload.output_lens[i:i + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest_out,
                       min_new_tokens=longest_out, do_sample=False, pad_token_id=0, eos_token_id=None)
    _sync(device)
    seconds = time.perf_counter() - start
    result = {"hf_seconds": seconds, "hf_output_tok_s": workload.num_output_tokens / seconds,
              "hf_batch_size": batch_size}
    if device.startswith("cuda"):
        result["hf_peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return result


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _peak_memory_gb(device: str) -> float:
    """Peak GPU memory allocated (KV cache included), or on CPU the process's peak resident set."""
    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # process peak RSS (KiB on Linux)


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    low_value, high_value = int(low), int(high or low)
    if not 1 <= low_value <= high_value:
        raise argparse.ArgumentTypeError(f"expected A:B with 1 <= A <= B, got {text!r}")
    return low_value, high_value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint folder (a folder with only config.json: random weights)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), help="reference workload of shared/anchors")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts to run (default: the workload's, else 64)")
    parser.add_argument("--input-len", type=_range, default=(128, 1024), metavar="A:B",
                        help="prompt lengths, drawn uniformly from A..B (default 128:1024)")
    parser.add_argument("--output-len", type=_range, default=(64, 512), metavar="C:D",
                        help="output lengths, drawn uniformly from C..D (default 64:512)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and lengths (default 0)")
    parser.add_argument("--baseline", choices=["hf", "none"], default="none",
                        help="hf: transformers' generate on the same prompts, in the same run (default none)")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="batch size of the hf baseline (default 64)")
    parser.add_argument("--sharing", choices=["n4", "prefix", "beam"],
                        help="memory sharing on vs off: 4 samples per prompt, a shared system prompt, or the "
                             "blocks beam search (width 4) shares")
    parser.add_argument("--prefix-len", type=int, default=512, help="system prompt length for --sharing prefix")
    add_engine_arguments(parser)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float16, bfloat16, float32")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV cache blocks (default: sized from --gpu-memory-utilization on CUDA)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of GPU memory the engine may use, KV cache included (default 0.9)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once at most (default 256)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="tokens per engine step at most: the prefill chunk budget (default 8192)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule step t+1 while step t runs (default: on)")


def engine_kwargs_from(args: argparse.Namespace) -> dict:
    return dict(device=args.device, dtype=args.dtype, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
                async_scheduling=args.async_scheduling)


def run(args: argparse.Namespace) -> dict:
    if args.workload:
        spec = WORKLOADS[args.workload]
        model_dir = str(_config_only_folder(spec["shape"]))
        num_prompts = args.num_prompts or spec["num_prompts"]
    elif args.model:
        model_dir, num_prompts = args.model, args.num_prompts or 64
    else:
        raise SystemExit("pagedq bench throughput: give --model DIR or --workload W1|W8")
    from engine.config import ModelConfig

    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    if args.sharing:
        from engine.bench_sharing import run_sharing

        return run_sharing(args.sharing, model_dir, vocab, args, engine_kwargs_from(args))
    workload = draw_workload(num_prompts, args.input_len, args.output_len, vocab, args.seed)
    # one JSON record: its values are whatever the runs report
    result: dict[str, Any] = {
        "bench": "throughput", "date": time.strftime("%Y-%m-%d"), "workload": args.workload or "custom",
        "num_prompts": num_prompts, "input_len": list(args.input_len), "output_len": list(args.output_len),
        "output_tokens": workload.num_output_tokens, "torch": torch.__version__}
    result.update(run_engine(model_dir, workload, engine_kwargs_from(args)))
    if args.baseline == "hf":
        from engine.config import resolve_dtype

        dtype = resolve_dtype(args.dtype, result["device"])
        result.update(run_hf(model_dir, workload, args.hf_batch_size, result["device"], dtype))
        result["ratio"] = result["engine_output_tok_s"] / result["hf_output_tok_s"]
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
    return result


def main(args: argparse.Namespace) -> int:
    print(json.dumps(run(args)), flush=True)
    return 0
