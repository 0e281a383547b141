"""`pagedq bench host --sampling json`: the simulated-device bench (engine/bench/host.py) with a fraction of the
sequences under a JSON schema. The host does everything it does for real (matchers accept each token, mask rows
are filled, async: for the step already running); the stand-in device sleeps out the forward, then waits for the
step's mask as the real sampler would, and draws a token each row's mask allows (deterministic, so the async and
sync runs must agree). Busy time is the forward alone: the wait for the mask counts as the device idling.

The tokenizer is the demo model's (SmolLM2, 49,152 tokens) padded to --vocab-size: the mask rows span the whole
vocabulary, as a 128k-vocab model's would.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path

import torch

from engine.bench.host import _STAND_IN_SHAPE, DeviceTimeline

# Never complete within the run: 64 strings at least, so every structured row stays structured to the end.
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 64}},
    "required": ["items"],
}
_WINDOW = 64  # mask words searched from each row's offset before a full scan


def model_folder(vocab_size: int) -> str:
    from engine.bench.throughput import _config_only_folder
    from engine.demo_model import demo_model_path

    folder = _config_only_folder({**_STAND_IN_SHAPE, "vocab_size": vocab_size})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        source = Path(demo_model_path()) / name
        if source.exists():
            shutil.copy(source, folder / name)
    return str(folder)


def allowed_tokens(bitmask: torch.Tensor, rows: list[int], offsets: torch.Tensor) -> torch.Tensor:
    """One allowed token per row: the lowest set bit of the first non-zero mask word at or after its offset."""
    words = bitmask[rows].to(torch.int64) & 0xFFFFFFFF
    width = words.shape[1]
    window = (offsets[:, None] + torch.arange(_WINDOW)[None, :]) % width
    near = words.gather(1, window)
    hit = near != 0
    index = window.gather(1, hit.to(torch.int8).argmax(dim=1, keepdim=True)).squeeze(1)
    missing = ~hit.any(dim=1)
    if missing.any():
        index[missing] = (words[missing] != 0).to(torch.int8).argmax(dim=1)
    word = words.gather(1, index[:, None]).squeeze(1)
    lowest = word & (-word)
    return index * 32 + torch.log2(lowest.to(torch.float64)).round().to(torch.int64)


def stand_in_device(runner, simulated_s: float, timeline: MaskTimeline):
    state = runner.state

    def device_work(step):
        from engine.async_step import DeviceResult
        from engine.sampler import SamplerOutput

        start = time.perf_counter()
        for op in step.device_ops:
            op()
        time.sleep(max(0.0, simulated_s - (time.perf_counter() - start)))  # the forward
        forward_end = waited = time.perf_counter()
        decode_only = step.inputs is not None and step.inputs.is_decode_only
        sampled = None
        if step.sampling is not None:
            plan = step.sampling
            draws = torch.from_numpy(plan.seeds + plan.positions * 7919 + plan.draw_index)
            tokens = draws % (state.vocab_size - 10) + 10
            mask = getattr(step.constrain, "__self__", None)
            if mask is not None:
                mask._ready.wait()  # the sampler waits here for the host's rows (StepMask.apply)
                waited = time.perf_counter()
                rows = mask.draw_rows
                tokens[rows] = allowed_tokens(mask.bitmask, rows, draws[rows] % mask.bitmask.shape[1])
            state.record_draws(plan, tokens)
            sampled = SamplerOutput(tokens, None, None, None)
        # busy: the forward and the draw; the wait for the mask between them is the device idling
        end = time.perf_counter()
        timeline.spans.append((start, end - (waited - forward_end), decode_only))
        timeline.waits.append(waited - forward_end)
        timeline.ends.append(end)
        return DeviceResult(sampled, {})

    return device_work


def run_mode(args: argparse.Namespace, model_dir: str, async_scheduling: bool) -> dict:
    from engine import LLMEngine, RequestOutputKind, SamplingParams, StructuredOutputsParams

    blocks_per_seq = -(-(args.prompt_len + args.output_len) // 16)
    engine = LLMEngine(
        model_dir,
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=8192,
        num_kv_blocks=args.num_seqs * blocks_per_seq + 16,
        async_scheduling=async_scheduling,
    )
    runner = engine.model_runner
    timeline = MaskTimeline()
    runner._device_work = stand_in_device(runner, args.simulated_device_ms / 1e3, timeline)
    rng = random.Random(args.seed)
    vocab = engine.tokenizer.vocab_size
    constraint = StructuredOutputsParams(json=SCHEMA)
    num_structured = round(args.structured_fraction * args.num_seqs)
    for i in range(args.num_seqs):
        prompt = [rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)]
        params = SamplingParams(
            max_tokens=args.output_len,
            temperature=0.0,
            ignore_eos=True,
            seed=i,
            output_kind=RequestOutputKind.FINAL_ONLY,
            structured_outputs=constraint if i < num_structured else None,
        )
        engine.add_request(f"host-{i}", prompt, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                if output.error is not None:
                    raise RuntimeError(f"{output.request_id}: {output.error}")
                tokens[output.request_id] = output.outputs[0].token_ids
    stats = engine.stats()
    runner.device_queue.close()
    assert all(len(t) == args.output_len for t in tokens.values()) and len(tokens) == args.num_seqs
    return {
        **timeline.summary(),
        "num_steps": stats["num_steps"],
        "host_work_ms_per_step": stats["schedule_ms_per_step"] + stats["postprocess_ms_per_step"],
        "tokens": tokens,
    }


class MaskTimeline(DeviceTimeline):
    """Each step's span holds its busy time (forward + draw); its wait for the mask is idle, kept apart."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []
        self.ends: list[float] = []

    def summary(self) -> dict[str, float]:
        decode = [i for i, (_, _, decode_only) in enumerate(self.spans) if decode_only]
        if len(decode) < 2:
            raise ValueError("fewer than two decode steps: raise --output-len")
        wall = self.ends[decode[-1]] - self.spans[decode[0]][0]
        busy = sum(self.spans[i][1] - self.spans[i][0] for i in decode)
        return {
            "num_decode_steps": len(decode),
            "device_busy_fraction": busy / wall,
            "host_ms_per_step": 1e3 * (wall - busy) / len(decode),  # idle device time per step
            "mask_wait_ms_per_step": 1e3 * sum(self.waits[i] for i in decode) / len(decode),
            "decode_wall_s": wall,
        }


def run(args: argparse.Namespace) -> dict:
    if args.device != "cpu":
        raise SystemExit("pagedq bench host --sampling json runs on the stand-in device only (--device cpu)")
    if not 0.0 <= args.structured_fraction <= 1.0:
        raise ValueError(f"--structured-fraction must be in [0, 1], got {args.structured_fraction}")
    import importlib.metadata

    model_dir = model_folder(args.vocab_size)
    results = {mode: run_mode(args, model_dir, mode == "async") for mode in ("async", "sync")}
    if results["async"].pop("tokens") != results["sync"].pop("tokens"):
        raise RuntimeError("async and sync runs generated different tokens")
    return {
        "bench": "host",
        "device": "cpu (stand-in)",
        "num_seqs": args.num_seqs,
        "sampling": "json",
        "structured_fraction": args.structured_fraction,
        "vocab_size": args.vocab_size,
        "simulated_device_ms": args.simulated_device_ms,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "torch": torch.__version__,
        "xgrammar": importlib.metadata.version("xgrammar"),
        **{f"{mode}_{key}": value for mode, result in results.items() for key, value in result.items()},
        "tokens_identical": True,
    }


def main(args: argparse.Namespace) -> int:
    if not args.simulated_device_ms >= 0:
        raise ValueError(f"--simulated-device-ms must be >= 0, got {args.simulated_device_ms}")
    print(json.dumps(run(args)))
    return 0
