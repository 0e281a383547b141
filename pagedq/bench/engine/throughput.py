"""`pagedq bench throughput`: this engine against transformers' generate on the same seeded workload, same process.

The workload is random token ids with EOS ignored, so both systems generate exactly the drawn number of
tokens. `--workload W1|W8` rebuilds the reference workloads of shared/anchors (model shape with random
weights, identical request draws) so GPU figures compare with the baselines measured there.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagedq.bench.engine.args import GROUNDED, MOE_WORKLOADS, OWN_FLAGS, WORKLOADS
from pagedq.bench.engine.workload import Workload, draw_workload, left_padded
from pagedq.engine.options import engine_kwargs_from


def _config_only_folder(shape: dict, model_type: str = "llama") -> Path:
    """A folder holding only the config.json of `shape` (random weights), as transformers' `model_type` config."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder = Path(tempfile.mkdtemp(prefix="pagedq-shape-"))
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    AutoConfig.for_model(model_type, **shape, architectures=[architecture]).save_pretrained(folder)
    return folder


def _workload_folder(name: str) -> Path:
    """The config-only folder of a named workload (reference or mixture-of-experts shape)."""
    if name in MOE_WORKLOADS:
        spec = MOE_WORKLOADS[name]
        return _config_only_folder(spec["shape"], spec["model_type"])
    return _config_only_folder(WORKLOADS[name]["shape"])


def run_engine(model_dir: str, workload: Workload, engine_kwargs: dict, step_parts: bool = False) -> dict:
    """The engine's run of the workload; with step_parts, then one decode step of its batch part by part."""
    from pagedq.engine import LLMEngine, RequestOutputKind, SamplingParams
    from pagedq.engine.startup import freeze_startup_objects

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
    result = {
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
        "async_scheduling": engine.config.async_scheduling,
        "intra_op_threads": torch.get_num_threads(),
        **{key: stats[key] for key in ("schedule_ms_per_step", "execute_ms_per_step", "postprocess_ms_per_step")},
    }
    if step_parts:
        result.update(_step_parts(engine, workload))
    engine.model_runner.device_queue.close()  # its thread holds the runner: let the engine go when the caller does
    return result


def _step_parts(engine, workload: Workload) -> dict:
    """One decode step of the batch the engine ran (its first max_num_seqs requests, halfway through their
    outputs), timed part by part on the engine's model and cache (pagedq/bench/engine/step_parts.py)."""
    from pagedq.bench.engine.step_parts import measure_step_parts

    if engine.model_config.moe is not None:  # its parts list the dense MLP's matmuls, not a routed step's
        return {"step_parts_skipped": "not split for mixture-of-experts layers yet"}
    batch = min(len(workload.prompts), engine.config.max_num_seqs)
    contexts = [len(p) + out // 2 for p, out in zip(workload.prompts[:batch], workload.output_lens[:batch])]
    runner = engine.model_runner
    needed = sum(-(-n // runner.block_size) for n in contexts)
    if needed > runner.num_blocks:
        return {"step_parts_skipped": f"the step needs {needed} KV blocks, the pool has {runner.num_blocks}"}
    try:
        return measure_step_parts(runner.model, runner.kv_caches, runner.block_size, contexts)
    except torch.cuda.OutOfMemoryError as error:  # the KV pool holds most of the GPU: keep the run's own figures
        torch.cuda.empty_cache()
        return {"step_parts_skipped": f"out of GPU memory beside the KV pool: {str(error).splitlines()[0]}"}


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
        ids, mask = left_padded(prompts)
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
    if args.workload == GROUNDED or args.batch_sizes or args.speculative_config:
        return _run_sweep(args)
    if args.workload:
        spec = MOE_WORKLOADS.get(args.workload) or WORKLOADS[args.workload]
        model_dir = str(_workload_folder(args.workload))
        num_prompts = args.num_prompts or spec["num_prompts"]
    elif args.model:
        model_dir, num_prompts = args.model, args.num_prompts or 64
    else:
        raise SystemExit("pagedq bench throughput: give --model DIR or --workload W1|W8|MOE-S|MOE-M|GPTOSS-M")
    from pagedq.engine.config.engine import ModelConfig

    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    if args.sharing:
        from pagedq.bench.engine.sharing import run_sharing

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
    result.update(_run_engines(model_dir, workload, args))
    if args.baseline == "hf":
        result.update(_run_hf_baselines(model_dir, workload, args, result))
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
    return result


def _run_sweep(args: argparse.Namespace) -> dict:
    """Each --batch-sizes, with and without --speculative-config (pagedq/bench/engine/speculative.py)."""
    from pagedq.bench.engine.speculative import run_sweep
    from pagedq.engine.config.engine import ModelConfig

    if args.workload in WORKLOADS or args.workload in MOE_WORKLOADS:
        model_dir = str(_workload_folder(args.workload))
    elif args.model:
        model_dir = args.model
    elif args.workload == GROUNDED:
        from pagedq.engine.demo_model import demo_model_path

        model_dir = str(demo_model_path())
    else:
        raise SystemExit("pagedq bench throughput: give --model DIR or --workload W1|W8|grounded")
    result: dict[str, Any] = {
        "bench": "throughput",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workload": args.workload or "custom",
        "model": model_dir,
        "input_len": list(args.input_len),
        "output_len": list(args.output_len),
        "torch": torch.__version__,
        "transformers": _transformers_version(),
        "intra_op_threads": torch.get_num_threads(),
    }
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    result.update(run_sweep(model_dir, vocab, args, bench_engine_kwargs(args)))
    return result


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _run_engines(model_dir: str, workload: Workload, args: argparse.Namespace) -> dict:
    """The engine's record; with --scheduling both, async and then sync, each one's tok/s and step time beside it
    (the record's other fields are the engine's default mode's)."""
    kwargs = bench_engine_kwargs(args)
    if args.scheduling != "both":
        return run_engine(model_dir, workload, kwargs, step_parts=args.step_parts)
    from pagedq.engine.config.engine import EngineConfig

    default = "async" if EngineConfig(model=model_dir, **kwargs).async_scheduling else "sync"
    runs = {}
    for mode in sorted(("async", "sync"), key=lambda m: m != default):  # the default first: its peak RSS is its own
        runs[mode] = run_engine(
            model_dir, workload, {**kwargs, "async_scheduling": mode == "async"}, args.step_parts and mode == default
        )
        gc.unfreeze()  # run_engine froze the engine it built (as the worker does): collect it before the next
        gc.collect()
    result = dict(runs[default])
    for mode, run in runs.items():
        result[f"engine_{mode}_output_tok_s"] = run["engine_output_tok_s"]
        result[f"engine_{mode}_execute_ms_per_step"] = run["execute_ms_per_step"]
    return result


def _run_hf_baselines(model_dir: str, workload: Workload, args: argparse.Namespace, engine: dict) -> dict:
    """transformers at each --hf-batch-size; the top-level hf fields and `ratio` are against the fastest of them
    (the strongest baseline), every run with its own ratio in `hf_runs`."""
    from pagedq.engine.config.engine import resolve_dtype

    dtype = resolve_dtype(args.dtype, engine["device"])
    runs = [run_hf(model_dir, workload, size, engine["device"], dtype) for size in args.hf_batch_size]
    for run in runs:
        run["ratio"] = engine["engine_output_tok_s"] / run["hf_output_tok_s"]
    best = max(runs, key=lambda run: run["hf_output_tok_s"])
    return {**best, "hf_runs": runs}


def main(args: argparse.Namespace) -> int:
    print(json.dumps(run(args)), flush=True)
    return 0
