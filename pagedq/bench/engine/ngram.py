"""`pagedq bench ngram`: the n-gram proposer's cost per engine step, against scanning each history, same run.

Each of --num-seqs sequences has a history (a seeded repetitive token stream: random tokens with stretches copied
from earlier, as input-grounded text repeats its input) and a fixed true continuation. Each step every sequence
gets up to k drafts; the drafts that match its continuation are accepted with one token more (greedy verification)
and appended. The same steps run twice: on the proposer (propose + append per sequence) and on the baseline, a
numpy scan of the whole history per step and n (candidates for the n-gram's first token, filtered token by token;
vLLM's CPU proposer scans each history too, compiled). Both must propose the same drafts; the record says they did.
A pure-Python scan (the tests' reference) is timed on the first step too. Memory: tracemalloc over adding the
histories. Numbers only, no model: torch is not imported.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np

from pagedq.engine.config.speculative import SpeculativeConfig
from pagedq.engine.spec_decode.ngram import NgramProposer


@dataclass
class Sequences:
    histories: list[list[int]]  # what each sequence starts from
    continuations: list[list[int]]  # what verification accepts, token by token


def draw_sequences(args: argparse.Namespace) -> Sequences:
    rng = random.Random(args.seed)
    extra = args.steps * 32  # more than any run of steps can consume (at most k + 1 <= 17 tokens a step)
    histories, continuations = [], []
    for _ in range(args.num_seqs):
        stream = repetitive_stream(rng, rng.randint(*args.history_len) + extra, args.vocab_size, args.copy_rate)
        cut = len(stream) - extra
        histories.append(stream[:cut])
        continuations.append(stream[cut:])
    return Sequences(histories, continuations)


def repetitive_stream(rng: random.Random, length: int, vocab: int, copy_rate: float) -> list[int]:
    """Random tokens with stretches of 4..32 tokens copied from earlier, `copy_rate` of the stretches."""
    tokens: list[int] = []
    while len(tokens) < length:
        if tokens and rng.random() < copy_rate:
            start = rng.randrange(len(tokens))
            tokens.extend(tokens[start : start + rng.randint(4, 32)])
        else:
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 8)))
    return tokens[:length]


def scan_propose(tokens: np.ndarray, length: int, min_n: int, max_n: int, limit: int) -> list[int]:
    """The proposer's answer by scanning tokens[:length]: the latest earlier match of the longest n."""
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n : length]
        starts = np.flatnonzero(tokens[: length - n] == suffix[0])  # an earlier occurrence starts before it
        for offset in range(1, n):
            starts = starts[tokens[starts + offset] == suffix[offset]]
        if starts.size:
            begin = int(starts[-1]) + n
            return tokens[begin : min(begin + limit, length)].tolist()
    return []


def python_scan_propose(history: list[int], min_n: int, max_n: int, limit: int) -> list[int]:
    length = len(history)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = history[length - n :]
        for start in range(length - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + limit]
    return []


def accepted(drafts: list[int], continuation: list[int], done: int) -> list[int]:
    """The tokens a greedy verification makes final: the drafts that match, then the next true token."""
    count = 0
    while count < len(drafts) and drafts[count] == continuation[done + count]:
        count += 1
    return continuation[done : done + count + 1]


Timings = list[tuple[float, float]]  # per step: wall seconds, CPU seconds of this process


def run_proposer(sequences: Sequences, config: SpeculativeConfig, steps: int) -> tuple[Timings, list[list]]:
    proposer = _proposer_of(sequences, config)
    done = [0] * len(sequences.histories)
    step_seconds: Timings = []
    proposals = []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        drafts = [proposer.propose(str(i), config.num_speculative_tokens) for i in range(len(done))]
        for i, draft in enumerate(drafts):
            new = accepted(draft, sequences.continuations[i], done[i])
            proposer.append(str(i), new)
            done[i] += len(new)
        step_seconds.append((time.perf_counter() - start, time.process_time() - cpu_start))
        proposals.append(drafts)
    return step_seconds, proposals


def run_scan(sequences: Sequences, config: SpeculativeConfig, steps: int) -> tuple[Timings, list[list]]:
    arrays, lengths = [], []
    for history, continuation in zip(sequences.histories, sequences.continuations):
        array = np.zeros(len(history) + len(continuation), dtype=np.int32)
        array[: len(history)] = history
        arrays.append(array)
        lengths.append(len(history))
    done = [0] * len(arrays)
    k, low, high = config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
    step_seconds: Timings = []
    proposals = []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        drafts = [scan_propose(array, length, low, high, k) for array, length in zip(arrays, lengths)]
        for i, draft in enumerate(drafts):
            new = accepted(draft, sequences.continuations[i], done[i])
            arrays[i][lengths[i] : lengths[i] + len(new)] = new
            lengths[i] += len(new)
            done[i] += len(new)
        step_seconds.append((time.perf_counter() - start, time.process_time() - cpu_start))
        proposals.append(drafts)
    return step_seconds, proposals


def measure_memory(sequences: Sequences, config: SpeculativeConfig) -> dict[str, float]:
    """Bytes the proposer holds for the histories (tracemalloc), and its cost to add them and to fork each once."""
    start = time.perf_counter()
    proposer = _proposer_of(sequences, config)
    add_seconds = time.perf_counter() - start
    fork_seconds = []
    for i in range(len(sequences.histories)):
        start = time.perf_counter()
        proposer.fork(str(i), f"fork-{i}")
        fork_seconds.append(time.perf_counter() - start)
    del proposer
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = _proposer_of(sequences, config)
    held = tracemalloc.get_traced_memory()[0] - before
    del kept
    tracemalloc.stop()
    tokens = sum(len(history) for history in sequences.histories)
    lookups = config.prompt_lookup_max - config.prompt_lookup_min + 1
    return {
        "history_tokens": tokens,
        "proposer_memory_mib": held / 2**20,
        "bytes_per_token": held / tokens,
        "bytes_per_token_per_n": held / tokens / lookups,
        "add_request_us_per_token": add_seconds / tokens * 1e6,
        "fork_us": float(np.median(fork_seconds)) * 1e6,  # the median: a fork that meets a GC pass is not its cost
    }


def _proposer_of(sequences: Sequences, config: SpeculativeConfig) -> NgramProposer:
    proposer = NgramProposer(config)
    for i, history in enumerate(sequences.histories):
        proposer.add_request(str(i), history)
    return proposer


def run(args: argparse.Namespace) -> dict[str, object]:
    config: SpeculativeConfig | None = args.speculative_config
    if config is None:
        raise ValueError("pagedq bench ngram: --speculative-config must name a config, not null")
    sequences = draw_sequences(args)
    proposer_s, proposed = run_proposer(sequences, config, args.steps)
    scan_s, scanned = run_scan(sequences, config, args.steps)
    start, cpu_start = time.perf_counter(), time.process_time()
    k, low, high = config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
    python_first = [python_scan_propose(history, low, high, k) for history in sequences.histories]
    python_scan_ms = (time.perf_counter() - start) * 1e3
    python_scan_cpu_ms = (time.process_time() - cpu_start) * 1e3
    drafts = [len(d) for step in proposed for d in step]
    proposer_ms, scan_ms = _median_ms(proposer_s, 0), _median_ms(scan_s, 0)
    proposer_cpu_ms, scan_cpu_ms = _median_ms(proposer_s, 1), _median_ms(scan_s, 1)
    return {
        "bench": "ngram",
        "date": time.strftime("%Y-%m-%d"),
        "speculative_config": config.to_dict(),
        "num_seqs": args.num_seqs,
        "history_len": list(args.history_len),
        "steps": args.steps,
        "vocab_size": args.vocab_size,
        # medians over the steps; the CPU time of this process too, the figure a shared machine leaves honest
        "proposer_ms_per_step": proposer_ms,
        "scan_ms_per_step": scan_ms,
        "speedup_vs_scan": scan_ms / proposer_ms,
        "proposer_cpu_ms_per_step": proposer_cpu_ms,
        "scan_cpu_ms_per_step": scan_cpu_ms,
        "cpu_speedup_vs_scan": scan_cpu_ms / proposer_cpu_ms,
        "python_scan_ms_first_step": python_scan_ms,  # proposals only (no appends), the first step
        "python_scan_cpu_ms_first_step": python_scan_cpu_ms,
        "proposals_identical": proposed == scanned and python_first == proposed[0],
        "mean_drafts_per_seq_step": sum(drafts) / len(drafts),
        "rows_with_drafts": sum(1 for n in drafts if n) / len(drafts),
        **measure_memory(sequences, config),
    }


def _median_ms(timings: Timings, clock: int) -> float:
    return float(np.median([step[clock] for step in timings])) * 1e3


def main(args: argparse.Namespace) -> int:
    print(json.dumps(run(args)), flush=True)
    return 0
