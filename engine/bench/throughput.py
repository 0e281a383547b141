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
from typing import Any

import torch

from engine.bench.args import OWN_FLAGS, WORKLOADS
from engine.options import engine_kwargs_from


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def draw_workload(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int = 0
) -> Workload:
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
    return {
        "engine_seconds": seconds,
        "engine_output_tok_s": generated / seconds,
        "engine_generated_tokens": generated,
        "kv_slot_utilization": stats["mean_kv_slot_utilization"],
        "num_preemptions": stats["num_preemptions"] - preemptions_before,
        "num_kv_blocks": engine.num_total_blocks,
        "device": engine.config.device,
        "dtype": str(engine.config.dtype).removeprefix("torch."),
        "peak_memory_gb": _peak_memory_gb(engine.config.device),
        "num_steps": stats["num_steps"],
        "num_graph_steps": stats["num_graph_steps"],
        "graph_capture_s": engine.model_runner.graph_capture_seconds,
        **{key: stats[key] for key in ("schedule_ms_per_step", "execute_ms_per_step", "postprocess_ms_per_step")},
    }


def _run_engine_once(engine, workload: Workload, kinds, params_cls) -> int:
    for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.output_lens)):
        params = params_cls(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=kinds.FINAL_ONLY)
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
        prompts = workload.prompts[i : i + batch_size]
        longest_out = max(workload.output_lens[i : i + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=longest_out,
            min_new_tokens=longest_out,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    _sync(device)
    seconds = time.perf_counter() - start
    result = {
        "hf_seconds": seconds,
        "hf_output_tok_s": workload.num_output_tokens / seconds,
        "hf_batch_size": batch_size,
    }
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


def bench_engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine's keywords: every engine flag but --seed, which here seeds the workload."""
    return engine_kwargs_from(args, exclude=OWN_FLAGS)


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
        from engine.bench.sharing import run_sharing

        return run_sharing(args.sharing, model_dir, vocab, args, bench_engine_kwargs(args))
    workload = draw_workload(num_prompts, args.input_len, args.output_len, vocab, args.seed)
    # one JSON record: its values are whatever the runs report
    result: dict[str, Any] = {
        "bench": "throughput",
        "date": time.strftime("%Y-%m-%d"),
        "workload": args.workload or "custom",
        "num_prompts": num_prompts,
        "input_len": list(args.input_len),
        "output_len": list(args.output_len),
        "output_tokens": workload.num_output_tokens,
        "torch": torch.__version__,
    }
    result.update(run_engine(model_dir, workload, bench_engine_kwargs(args)))
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
