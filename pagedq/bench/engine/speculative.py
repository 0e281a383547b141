"""`pagedq bench throughput --batch-sizes ... [--speculative-config JSON] [--workload grounded]`: the workload at
each batch size B (max_num_seqs = B; B x --requests-per-seat requests, so seats refill as requests finish and
the slowest request does not set the pace), without speculation and with it, same run: --repeats pairs of runs
(default 2), in ABBA order (off, on, on, off; the next batch size on, off, off, on), since a process's first
engine runs slower and the mode that always went first would pay for it.

Per batch size: output tok/s of each run, each pair's ratio and their mean, whether the greedy outputs are
token-identical (they must be), the draft counters of the engine's stats() (drafts verified, drafts accepted,
rows that carried a draft) and what they give (acceptance rate, accepted tokens per verifying row), steps and
execute time per step of each.
--baseline hf adds transformers' generate at the same batch size on the same prompts, and with
--hf-prompt-lookup its own prompt lookup (`prompt_lookup_num_tokens`, batch 1 only in transformers).

Grounded prompts honour EOS (max_tokens: the upper bound of --output-len), so each request's output is what the
model would write; the random-token workload ignores EOS, as the throughput bench does.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass

import torch

from pagedq.bench.engine.args import GROUNDED, GROUNDED_BATCH_SIZES
from pagedq.bench.engine.workload import left_padded
from pagedq.engine.config.speculative import SpeculativeConfig

SPEC_COUNTERS = (
    "num_draft_tokens",
    "num_accepted_draft_tokens",
    "num_verify_rows",
    "num_spec_off_steps",
    "num_grammar_cut_draft_tokens",
)
DEFAULT_GROUNDED_PROMPTS = 4  # at least this many requests per batch size (batch 1 runs them one by one)


@dataclass
class Requests:
    prompts: list[list[int]]
    max_tokens: list[int]
    ignore_eos: bool

    def first(self, count: int) -> Requests:
        return Requests(self.prompts[:count], self.max_tokens[:count], self.ignore_eos)


@dataclass
class EngineRun:
    record: dict[str, float]
    outputs: list[list[int]]  # each request's output tokens, in request order


def build_requests(model_dir: str, vocab: int, args: argparse.Namespace, count: int) -> tuple[Requests, dict]:
    if args.workload == GROUNDED:
        from transformers import AutoTokenizer

        from pagedq.bench.engine.grounded import build_grounded

        workload = build_grounded(AutoTokenizer.from_pretrained(model_dir), count, args.input_len, args.seed)
        return Requests(workload.prompts, [args.output_len[1]] * count, ignore_eos=False), workload.summary()
    from pagedq.bench.engine.workload import draw_workload

    drawn = draw_workload(count, args.input_len, args.output_len, vocab, args.seed)
    return Requests(drawn.prompts, drawn.output_lens, ignore_eos=True), {}


def run_engine(model_dir: str, requests: Requests, engine_kwargs: dict) -> EngineRun:
    """One engine built for the run, warmed up on two short requests, then the requests all added at once."""
    from pagedq.engine import LLMEngine, RequestOutputKind, SamplingParams
    from pagedq.engine.startup import freeze_startup_objects

    engine = LLMEngine(model_dir, **engine_kwargs)
    freeze_startup_objects()

    def params(max_tokens: int) -> SamplingParams:
        kind = RequestOutputKind.FINAL_ONLY
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=requests.ignore_eos, output_kind=kind)

    for i in range(2):
        engine.add_request(f"warm-{i}", requests.prompts[i % len(requests.prompts)][:16], params(4))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_step_stats()
    before = engine.stats()
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(zip(requests.prompts, requests.max_tokens)):
        engine.add_request(f"r{i}", prompt, params(max_tokens))
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = list(output.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    after = engine.stats()
    engine.model_runner.device_queue.close()
    del engine
    gc.unfreeze()  # freeze_startup_objects froze this engine: let the collector have it before the next
    gc.collect()
    generated = sum(len(tokens) for tokens in outputs.values())
    record = {
        "output_tok_s": generated / seconds,
        "seconds": seconds,
        "generated_tokens": generated,
        "num_steps": after["num_steps"] - before["num_steps"],
        "execute_ms_per_step": after["execute_ms_per_step"],
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        **{key: after[key] - before[key] for key in SPEC_COUNTERS if key in after},
    }
    return EngineRun(record, [outputs[f"r{i}"] for i in range(len(requests.prompts))])


def speculation_figures(base: EngineRun, spec: EngineRun) -> dict[str, float]:
    """The ratio, the outputs' identity and what the draft counters say."""
    record = spec.record
    drafts, accepted, rows = (int(record.get(key, 0)) for key in SPEC_COUNTERS[:3])
    return {
        "speedup": record["output_tok_s"] / base.record["output_tok_s"],
        "identical_outputs": sum(a == b for a, b in zip(base.outputs, spec.outputs)),
        "draft_acceptance_rate": accepted / drafts if drafts else 0.0,
        "mean_accepted_tokens_per_step": accepted / rows if rows else 0.0,  # per row-step that carried drafts
        "mean_drafts_per_verify_row": drafts / rows if rows else 0.0,
    }


class HFRunner:
    """transformers' generate on the same prompts: static batches, left-padded, greedy, EOS honoured as the
    engine does (tokens counted up to and with EOS, and at most max_tokens per request)."""

    def __init__(self, model_dir: str, device: str, dtype: torch.dtype, eos_token_ids: tuple[int, ...]) -> None:
        from transformers import AutoModelForCausalLM

        # transformers types PreTrainedModel.to through a wrapper whose first parameter is the model, not the device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
        self.device, self.eos = device, list(eos_token_ids)
        warm = torch.tensor([[1, 2, 3, 4]], device=device)
        self.model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False)

    def run(self, requests: Requests, batch_size: int, prompt_lookup: SpeculativeConfig | None = None) -> dict:
        generated, start = 0, time.perf_counter()
        for i in range(0, len(requests.prompts), batch_size):
            generated += self._batch(requests.first(i + batch_size), i, prompt_lookup)
        seconds = time.perf_counter() - start
        return {"output_tok_s": generated / seconds, "seconds": seconds, "generated_tokens": generated}

    def _batch(self, requests: Requests, offset: int, prompt_lookup: SpeculativeConfig | None) -> int:
        prompts, caps = requests.prompts[offset:], requests.max_tokens[offset:]
        ids, mask = left_padded(prompts)
        extra = {}
        if prompt_lookup is not None:
            extra = {
                "prompt_lookup_num_tokens": prompt_lookup.num_speculative_tokens,
                "max_matching_ngram_size": prompt_lookup.prompt_lookup_max,
            }
        out = self.model.generate(
            ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=max(caps),
            do_sample=False,
            pad_token_id=self.eos[0] if self.eos else 0,
            eos_token_id=None if requests.ignore_eos else self.eos or None,
            min_new_tokens=max(caps) if requests.ignore_eos else None,  # EOS ignored: every request runs its length
            **extra,
        )
        return sum(self._count(row[ids.shape[1] :].tolist(), cap, requests.ignore_eos) for row, cap in zip(out, caps))

    def _count(self, tokens: list[int], cap: int, ignore_eos: bool) -> int:
        tokens = tokens[:cap]
        if not ignore_eos:
            for index, token in enumerate(tokens):
                if token in self.eos:
                    return index + 1
        return len(tokens)


def run_sweep(model_dir: str, vocab: int, args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedq.engine.config.engine import ModelConfig, resolve_dtype

    sizes = args.batch_sizes or GROUNDED_BATCH_SIZES
    num_prompts = args.num_prompts or DEFAULT_GROUNDED_PROMPTS
    config: SpeculativeConfig | None = args.speculative_config
    per_seat = args.requests_per_seat
    requests, summary = build_requests(model_dir, vocab, args, max(max(sizes) * per_seat, num_prompts))
    hf = None
    if args.baseline == "hf":
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        eos = ModelConfig.from_pretrained(model_dir).eos_token_ids
        hf = HFRunner(model_dir, device, resolve_dtype(args.dtype, device), eos)
    rows: list[dict[str, object]] = []
    for size in sizes:
        batch = requests.first(max(size * per_seat, num_prompts))
        kwargs = {**engine_kwargs, "max_num_seqs": size}
        row: dict[str, object] = {"batch_size": size, "num_requests": len(batch.prompts)}
        if config is None:
            base = run_engine(model_dir, batch, kwargs)
            row["engine"] = base.record
        else:
            base = _speculation_pairs(model_dir, batch, kwargs, config, args.repeats, len(rows), row)
        if hf is not None:
            hf_record = hf.run(batch, size)
            row["hf"] = hf_record
            row["engine_vs_hf"] = base.record["output_tok_s"] / hf_record["output_tok_s"]
            if config is not None and size == 1 and args.hf_prompt_lookup:
                row["hf_prompt_lookup"] = hf.run(batch, 1, prompt_lookup=config)
        rows.append(row)
        print(f"# batch {size}: {row}", flush=True)  # progress, one line per batch size (the record comes last)
    return {
        "speculative_config": config.to_dict() if config else None,
        "workload_summary": summary,
        "batch_sizes": sizes,
        "runs": rows,
    }


def run_order(repeats: int, first_pair: int) -> list[bool]:
    """Whether each run of a batch size speculates: `repeats` pairs, each pair's order the reverse of the one
    before it (off, on, on, off, ...: ABBA), and each batch size starting with the order its predecessor's first
    pair did not, so neither mode always pays for the first run (a process's first engine is slower)."""
    order = []
    for pair in range(first_pair, first_pair + repeats):
        order += [False, True] if pair % 2 == 0 else [True, False]
    return order


def _speculation_pairs(
    model_dir: str,
    batch: Requests,
    kwargs: dict,
    config: SpeculativeConfig,
    repeats: int,
    index: int,
    row: dict[str, object],
) -> EngineRun:
    """The batch size's runs without and with speculation in run_order; fills `row` and returns the first run
    without. Row: the first pair's records and figures (`engine`, `engine_speculative`, speculation_figures), every
    run of each mode (`engine_runs`, `engine_speculative_runs`), `order`, each pair's ratio (`speedups`) and their
    mean as `speedup`; `identical_outputs` counts the requests whose outputs agree across all the runs."""
    runs: dict[bool, list[EngineRun]] = {False: [], True: []}
    order = run_order(repeats, index)
    for speculate in order:
        extra = {"speculative_config": config} if speculate else {}
        runs[speculate].append(run_engine(model_dir, batch, {**kwargs, **extra}))
    base, spec = runs[False][0], runs[True][0]
    row["engine"], row["engine_speculative"] = base.record, spec.record
    row.update(speculation_figures(base, spec))
    speedups = [on.record["output_tok_s"] / off.record["output_tok_s"] for off, on in zip(runs[False], runs[True])]
    every = runs[False] + runs[True]
    row["order"] = ["on" if speculate else "off" for speculate in order]
    row["engine_runs"] = [run.record for run in runs[False]]
    row["engine_speculative_runs"] = [run.record for run in runs[True]]
    row["speedups"] = speedups
    row["speedup"] = sum(speedups) / len(speedups)
    row["identical_outputs"] = sum(
        len({tuple(run.outputs[i]) for run in every}) == 1 for i in range(len(batch.prompts))
    )
    return base
