"""`pagedq bench host`: the host time the device waits through per decode step, with async scheduling and without.

Everything on the host is the engine's own: scheduler, block manager, the runner's persistent batch and input
preparation, sampling-state updates, post-step stage and output processing. On CPU only the device part (forward
pass + sampler tensor work) is replaced, by a stand-in on the device thread that returns deterministic tokens and
takes `--simulated-device-ms` of wall time sleeping (not holding the GIL), as a GPU would be busy. The persistent
batch's own device writes (new rows, penalty rows, count scatters) still run, inside that time. On CUDA
(`--device cuda --model DIR`) nothing is replaced: the busy fraction comes from CUDA events recorded around each
step's device work on the compute stream, read once at the end.

    device_busy_fraction  device time of the decode steps / their wall time (first start to last end)
    host_ms_per_step      mean gap between consecutive decode steps' device work: host time the device waits through
    host_work_ms_per_step the engine thread's own work per step (schedule + prepare + launch + post-process)
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from dataclasses import dataclass, field

import torch

from pagedq.bench.engine.args import SAMPLINGS, WORKLOADS

_STAND_IN_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


@dataclass
class DeviceTimeline:
    """(start, end, decode-only) of each step's device work, in seconds. With a stand-in device (`simulated_s`) a
    span also holds the stand-in's late wake-up: its thread waits for the GIL while the engine thread runs Python,
    which a real device would spend idle, waiting for its next launch. So `forward_busy_fraction` counts the
    simulated forward alone, as the json run's MaskTimeline does: the two runs' busy figures compare."""

    spans: list[tuple[float, float, bool]] = field(default_factory=list)
    simulated_s: float | None = None

    def summary(self) -> dict[str, float]:
        decode = [(start, end) for start, end, decode_only in self.spans if decode_only]
        if len(decode) < 2:
            raise ValueError("fewer than two decode steps: raise --output-len")
        wall = decode[-1][1] - decode[0][0]
        busy = sum(end - start for start, end in decode)
        gaps = [max(0.0, start - previous_end) for (_, previous_end), (start, _) in itertools.pairwise(decode)]
        forward = {} if self.simulated_s is None else {"forward_busy_fraction": self.simulated_s * len(decode) / wall}
        return {
            "num_decode_steps": len(decode),
            "device_busy_fraction": busy / wall,
            **forward,
            "host_ms_per_step": 1e3 * sum(gaps) / len(gaps),
            "decode_wall_s": wall,
        }


class CudaTimeline(DeviceTimeline):
    """Events recorded on the stream around each device work; turned into spans once, at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []

    def summary(self) -> dict[str, float]:
        torch.cuda.synchronize()
        origin = self.events[0][0]
        self.spans = [(origin.elapsed_time(a) / 1e3, origin.elapsed_time(b) / 1e3, d) for a, b, d in self.events]
        return super().summary()


def stand_in_device(runner, simulated_s: float, timeline: DeviceTimeline):
    """The runner's device work replaced: state writes, deterministic draws, then sleep out the simulated time."""
    state = runner.state

    def device_work(step):
        from pagedq.engine.sample.sampler import SamplerOutput
        from pagedq.engine.step.async_step import DeviceResult

        start = time.perf_counter()
        for op in step.device_ops:
            op()
        sampled = None
        if step.sampling is not None:
            plan = step.sampling
            draws = plan.seeds + plan.positions * 7919 + plan.draw_index
            tokens = torch.from_numpy(draws % (state.vocab_size - 10) + 10)
            state.record_draws(plan, tokens)
            sampled = SamplerOutput(tokens, None, None, None)
        time.sleep(max(0.0, simulated_s - (time.perf_counter() - start)))
        timeline.spans.append((start, time.perf_counter(), step.inputs is not None and step.inputs.is_decode_only))
        return DeviceResult(sampled, {})

    return device_work


def timed_cuda_device(runner, timeline: CudaTimeline):
    real = runner._device_work

    def device_work(step):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = real(step)
        end.record()
        timeline.events.append((start, end, step.inputs is not None and step.inputs.is_decode_only))
        return result

    return device_work


def run_mode(args: argparse.Namespace, model_dir: str, async_scheduling: bool) -> dict:
    from pagedq.engine import LLMEngine, RequestOutputKind, SamplingParams

    blocks_per_seq = -(-(args.prompt_len + args.output_len) // 16)
    engine = LLMEngine(
        model_dir,
        device=args.device,
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=8192,
        num_kv_blocks=args.num_seqs * blocks_per_seq + 16 if args.device == "cpu" else None,
        async_scheduling=async_scheduling,
    )
    runner = engine.model_runner
    timeline = (
        CudaTimeline() if args.device.startswith("cuda") else DeviceTimeline(simulated_s=args.simulated_device_ms / 1e3)
    )
    runner._device_work = (
        timed_cuda_device(runner, timeline)
        if isinstance(timeline, CudaTimeline)
        else stand_in_device(runner, args.simulated_device_ms / 1e3, timeline)
    )
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    for i in range(args.num_seqs):
        prompt = [rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)]
        params = SamplingParams(
            max_tokens=args.output_len,
            ignore_eos=True,
            seed=i,
            output_kind=RequestOutputKind.FINAL_ONLY,
            **SAMPLINGS[args.sampling],
        )
        engine.add_request(f"host-{i}", prompt, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
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


def run(args: argparse.Namespace) -> dict:
    from pagedq.bench.engine.throughput import _config_only_folder

    if args.device.startswith("cuda"):
        if args.workload:
            model_dir = str(_config_only_folder(WORKLOADS[args.workload]["shape"]))
        elif args.model:
            model_dir = args.model
        else:
            raise SystemExit("pagedq bench host --device cuda: give --model DIR or --workload W1|W8 (a model runs)")
    elif args.model or args.workload:
        raise SystemExit("pagedq bench host: --model and --workload are for --device cuda (the CPU runs a stand-in)")
    else:
        model_dir = str(_config_only_folder({**_STAND_IN_SHAPE, "vocab_size": args.vocab_size}))
    results = {mode: run_mode(args, model_dir, mode == "async") for mode in ("async", "sync")}
    if results["async"].pop("tokens") != results["sync"].pop("tokens"):
        raise RuntimeError("async and sync runs generated different tokens")
    return {
        "bench": "host",
        "device": args.device,
        "num_seqs": args.num_seqs,
        "sampling": args.sampling,
        "vocab_size": args.vocab_size,
        "simulated_device_ms": args.simulated_device_ms if args.device == "cpu" else None,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "torch": torch.__version__,
        **{f"{mode}_{key}": value for mode, result in results.items() for key, value in result.items()},
        "tokens_identical": True,
    }


def main(args: argparse.Namespace) -> int:
    if not args.simulated_device_ms >= 0:
        raise ValueError(f"--simulated-device-ms must be >= 0, got {args.simulated_device_ms}")
    print(json.dumps(run(args)))
    return 0
