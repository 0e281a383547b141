"""`pagedq bench host --sampling json`: the simulated-device bench (pagedq/bench/engine/host.py) with a fraction of the
sequences under a JSON schema. The host does everything it does for real (matchers accept each token, mask rows
are filled, async: for the step already running); the stand-in device sleeps out the forward, then waits for the
step's mask as the real sampler would, and draws a token each row's mask allows (deterministic, so the async and
sync runs must agree). Busy time is the simulated forward alone (MaskTimeline): everything else is the device idling.

The tokenizer is the demo model's (SmolLM2, 49,152 byte-level BPE tokens) widened to --vocab-size with merges of two
of its word pieces (letters and digits), so every id is a real token, as in a 128k-vocab model. Not padded ids:
xgrammar treats ids with no text as special tokens and clears each of them one by one in every row it fills inside
a JSON string (79,104 ids: about 0.1-0.2 ms per row that no real tokenizer costs). The punctuation tokens, which
decide how many tokens the matcher must check at run time, stay SmolLM2's: a real 128k tokenizer has more of them.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from pagedq.bench.engine.host import _STAND_IN_SHAPE, DeviceTimeline

# Extraction records; at least 64 of them, so no row completes within the run and every structured row stays
# structured to the end. No string maxLength: in xgrammar 0.2.8 a bounded string costs 2-40 ms per row filled
# inside it (xgrammar #852), which the docs measure apart.
SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "date": {"type": "string", "format": "date"},
                    "total": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["name", "date", "total", "tags"],
            },
        }
    },
    "required": ["records"],
}
_WINDOW = 64  # mask words searched from each row's offset before a full scan


def model_folder(vocab_size: int) -> str:
    from pagedq.bench.engine.throughput import _config_only_folder
    from pagedq.engine.demo_model import demo_model_path

    folder = _config_only_folder({**_STAND_IN_SHAPE, "vocab_size": vocab_size})
    source = Path(demo_model_path())
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    widen_vocabulary(tokenizer["model"], vocab_size)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(folder)


def widen_vocabulary(bpe: dict, vocab_size: int, seed: int = 0) -> None:
    """Add BPE tokens (each a merge of two word pieces already there) until the vocabulary has vocab_size ids."""
    vocab, merges = bpe["vocab"], bpe["merges"]
    words = [token for token in vocab if re.fullmatch(r"Ġ?[A-Za-z0-9]+", token)]
    tails = [token for token in words if not token.startswith("Ġ")]
    rng = random.Random(seed)
    while len(vocab) < vocab_size:
        head, tail = rng.choice(words), rng.choice(tails)
        if head + tail not in vocab:
            vocab[head + tail] = len(vocab)
            merges.append([head, tail])


def allowed_tokens(bitmask: torch.Tensor, rows: list[int], offsets: np.ndarray) -> np.ndarray:
    """One allowed token per row: the lowest set bit of the first non-zero mask word at or after its offset. Only
    that window of words is read, in numpy (no intra-op threads): the stand-in's draw must cost what a device's
    would, not compete with the host for the two cores."""
    words = bitmask.numpy()
    width = words.shape[1]
    row_index = np.asarray(rows, dtype=np.int64)
    window = (offsets[:, None] + np.arange(_WINDOW)[None, :]) % width
    hit = words[row_index[:, None], window] != 0
    index = window[np.arange(len(rows)), hit.argmax(axis=1)]
    missing = ~hit.any(axis=1)  # nothing allowed in the window (structural states): the first allowed word
    if missing.any():
        index[missing] = (words[row_index[missing]] != 0).argmax(axis=1)
    word = words[row_index, index].astype(np.int64) & 0xFFFFFFFF
    lowest = word & (-word)
    return index * 32 + np.log2(lowest.astype(np.float64)).round().astype(np.int64)


def stand_in_device(runner, simulated_s: float, timeline: MaskTimeline):
    state = runner.state

    def device_work(step):
        from pagedq.engine.sample.sampler import SamplerOutput
        from pagedq.engine.step.async_step import DeviceResult

        start = time.perf_counter()
        for op in step.device_ops:
            op()
        time.sleep(max(0.0, simulated_s - (time.perf_counter() - start)))  # the forward
        forward_end = waited = time.perf_counter()
        decode_only = step.inputs is not None and step.inputs.is_decode_only
        sampled = None
        if step.sampling is not None:
            plan = step.sampling
            draws = plan.seeds + plan.positions * 7919 + plan.draw_index
            tokens = draws % (state.vocab_size - 10) + 10
            mask = getattr(step.constrain, "__self__", None)
            if mask is not None:
                mask._ready.wait()  # the sampler waits here for the host's rows (StepMask.apply)
                waited = time.perf_counter()
                rows = mask.draw_rows
                tokens[rows] = allowed_tokens(mask.bitmask, rows, draws[rows] % mask.bitmask.shape[1])
                timeline.fills.append((mask.fill_seconds, mask.num_filled))
            state.record_draws(plan, torch.from_numpy(tokens))
            sampled = SamplerOutput(torch.from_numpy(tokens), None, None, None)
        # busy: the simulated forward alone (see MaskTimeline); the wait for the mask is the device idling
        end = time.perf_counter()
        timeline.spans.append((start, end, decode_only))
        timeline.waits.append(waited - forward_end)
        return DeviceResult(sampled, {})

    return device_work


def run_mode(args: argparse.Namespace, model_dir: str, async_scheduling: bool) -> dict:
    from pagedq.engine import LLMEngine, RequestOutputKind, SamplingParams, StructuredOutputsParams

    blocks_per_seq = -(-(args.prompt_len + args.output_len) // 16)
    engine = LLMEngine(
        model_dir,
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=8192,
        num_kv_blocks=args.num_seqs * blocks_per_seq + 16,
        async_scheduling=async_scheduling,
    )
    # No detokenizing, as in bench host's other runs (their checkpoint has no tokenizer): the tokenizer is here for
    # the grammars only, and detokenizing 256 sequences a step is host work of its own, not the mask's.
    engine.output_processor.tokenizer = None
    runner = engine.model_runner
    timeline = MaskTimeline(args.simulated_device_ms / 1e3)
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
    """A decode step keeps the device busy for exactly the simulated forward: the stand-in's late wake-ups (the
    GIL), its draw on the CPU and its wait for the mask all count as the device idling (a GPU's masked draw takes
    microseconds). So the busy fraction is a lower bound on what the same host gives a real device."""

    simulated_s: float

    def __init__(self, simulated_s: float) -> None:
        super().__init__(simulated_s=simulated_s)
        self.waits: list[float] = []
        self.fills: list[tuple[float, int]] = []  # (seconds, rows) of each mask fill

    def summary(self) -> dict[str, float]:
        decode = [i for i, (_, _, decode_only) in enumerate(self.spans) if decode_only]
        if len(decode) < 2:
            raise ValueError("fewer than two decode steps: raise --output-len")
        wall = self.spans[decode[-1]][1] - self.spans[decode[0]][0]
        busy = self.simulated_s * len(decode)
        return {
            "num_decode_steps": len(decode),
            "device_busy_fraction": busy / wall,
            "host_ms_per_step": 1e3 * (wall - busy) / len(decode),  # idle device time per step
            "mask_wait_ms_per_step": 1e3 * sum(self.waits[i] for i in decode) / len(decode),
            # xgrammar's own time filling the rows (BatchGrammarMatcher: wall time over its threads)
            "mask_fill_us_per_row": 1e6 * sum(s for s, _ in self.fills) / max(1, sum(n for _, n in self.fills)),
            "mask_fill_ms_per_step": 1e3 * sum(s for s, _ in self.fills) / max(1, len(self.fills)),
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
    # The same run with no row structured: what the engine's own host work leaves of the device at this batch,
    # measured the same way, so the mask's share is the difference (docs/benchmarks.md#structured-outputs).
    unconstrained = argparse.Namespace(**{**vars(args), "structured_fraction": 0.0})
    results["unconstrained_async"] = run_mode(unconstrained, model_dir, True)
    results["unconstrained_async"].pop("tokens")
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
