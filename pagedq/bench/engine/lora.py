"""`pagedq bench lora`: LoRA adapters per request, in one run on one model (default: the demo model), one JSON line.

    base      the engine on the workload, base model only (no adapters enabled)
    lora      the engine on the same workload with --num-adapters adapters spread over the batch, one per request
              in turn, all in one batch (target: >= 0.8x base's output tokens/s); base and lora alternate for
              --rounds rounds, each on a fresh draw of the workload: the median of the rounds' ratios is reported
    peft      transformers + PEFT `generate`, one adapter at a time (its requests as one left-padded batch), as a
              user without pagedq would serve them, on the first round's workload (target: lora >= 2x the first
              round's lora run)
    exact     the engine's greedy outputs under each adapter against PEFT's, request by request, and how many
              of them the adapter changed from the base model's (the comparison's power)

The adapters are random-weight PEFT folders (adapter_config.json + adapter_model.safetensors) written into a
temporary folder: q/k/v/o/gate/up/down targets, ranks drawn from --rank, every other one rsLoRA. Prompts are random
token ids and EOS is ignored, so every system generates exactly the drawn number of tokens. Loading is outside the
timings on both sides: the engine's adapters are loaded by a warm-up request each, PEFT's before its first batch.
PEFT is a bench dependency (pip install 'pagedq[test]'), never the engine's: without it the bench says so and
runs base and lora only.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedq.bench.engine.args import _positive, _range
from pagedq.engine.options import add_engine_arguments, engine_kwargs_from

if TYPE_CHECKING:  # the workload module imports torch: `pagedq --help` and the gateway image must not
    from pagedq.bench.engine.workload import Workload


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The bench's own flags, and the engine knobs it sets itself from them (enable_lora, the slots and the rank).
OWN_FLAGS = ("seed", "speculative_config", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
# The adapters' B matrices: each adapter moves a projection's output by about this much of a unit-scale input,
# enough that every adapter changes the greedy outputs, little enough that they stay a language model's.
ADAPTER_DELTA_SCALE = 0.05


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    rank: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the demo model)")
    parser.add_argument("--num-prompts", type=_positive, default=32, help="requests, all in one batch (default 32)")
    parser.add_argument(
        "--num-adapters", type=_positive, default=8, help="adapters spread over the requests in turn (default 8)"
    )
    parser.add_argument(
        "--rank", type=_range, default=(8, 16), metavar="A:B", help="adapter ranks, drawn from A..B (default 8:16)"
    )
    parser.add_argument(
        "--input-len", type=_range, default=(32, 96), metavar="A:B", help="prompt lengths (default 32:96)"
    )
    parser.add_argument(
        "--output-len", type=_range, default=(32, 64), metavar="C:D", help="output lengths (default 32:64)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and adapters (default 0)")
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=3,
        help="base and lora runs, alternating, each round on a fresh draw: the best tok/s of each and the median of "
        "the rounds' ratios are reported (default 3)",
    )
    parser.add_argument(
        "--baseline",
        choices=["peft", "none"],
        default="peft",
        help="peft: transformers + PEFT generate, one adapter at a time, in the same run (default peft)",
    )
    add_engine_arguments(parser, exclude=OWN_FLAGS)


def write_adapters(model_dir: str, folder: Path, count: int, ranks: tuple[int, int], seed: int) -> list[Adapter]:
    """`count` random-weight PEFT LoRA folders for the model in `model_dir`, under `folder`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {
        "q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out), "o_proj": (q_out, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    adapters = []
    for number in range(count):
        rank, rslora = rng.randint(*ranks), number % 2 == 1
        alpha = 2 * rank
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for target in TARGETS:
                in_features, out_features = shapes[target]
                parent = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{parent}.{target}"
                # A x has unit-scale entries; B spreads ADAPTER_DELTA_SCALE over rank and scaling
                a = torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features)
                b = torch.randn(out_features, rank, generator=generator) * (
                    ADAPTER_DELTA_SCALE / (math.sqrt(rank) * scaling)
                )
                tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
        path = folder / f"adapter-{number}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        adapter_config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": rank,
            "lora_alpha": alpha, "use_rslora": rslora, "lora_dropout": 0.0, "bias": "none",
            "target_modules": list(TARGETS), "fan_in_fan_out": False,
        }  # fmt: skip
        (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
        adapters.append(Adapter(f"bench-adapter-{number}", str(path), rank))
    return adapters


class EngineUnderTest:
    """An engine kept for the whole bench, so base and lora runs can alternate; adapters loaded at the warm-up."""

    def __init__(self, model_dir: str, engine_kwargs: dict, adapters: list[Adapter], warm_prompt: list[int]) -> None:
        from pagedq.engine import LLMEngine
        from pagedq.engine.lora.request import LoRARequest
        from pagedq.engine.startup import freeze_startup_objects

        self.engine = LLMEngine(model_dir, **engine_kwargs)
        freeze_startup_objects()  # as the worker does: measure the engine as it serves
        self.loras = {a.name: LoRARequest(a.name, a.path) for a in adapters}
        self.runs = 0
        warm_names: list[str | None] = [*self.loras] or [None]  # loads every adapter, outside the timing
        self._generate([warm_prompt] * len(warm_names), [2] * len(warm_names), warm_names)

    def run(self, workload: Workload, assignment: list[Adapter | None]) -> tuple[float, list[list[int]]]:
        """(seconds, each request's output ids) of the workload, request i under assignment[i]."""
        _sync(self.engine.config.device)
        start = time.perf_counter()
        outputs = self._generate(workload.prompts, workload.output_lens, [a.name if a else None for a in assignment])
        _sync(self.engine.config.device)
        return time.perf_counter() - start, outputs

    def _generate(self, prompts: list[list[int]], lengths: list[int], names: list[str | None]) -> list[list[int]]:
        from pagedq.engine import RequestOutputKind, SamplingParams

        self.runs += 1
        ids = [f"bench-lora-{self.runs}-{i}" for i in range(len(prompts))]
        for request_id, prompt, max_tokens, name in zip(ids, prompts, lengths, names):
            params = SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
            )
            self.engine.add_request(request_id, prompt, params, lora=self.loras[name] if name else None)
        outputs: dict[str, list[int]] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    outputs[output.request_id] = list(output.outputs[0].token_ids)
        return [outputs[request_id] for request_id in ids]

    def close(self) -> None:
        self.engine.model_runner.device_queue.close()  # its thread holds the runner: let the engine go


def run_peft(
    model_dir: str, workload: Workload, adapters: list[Adapter], assignment: list[Adapter | None], device: str
) -> tuple[float, list[list[int]], Any]:
    """(seconds, output ids, the PeftModel) of transformers + PEFT generate, one adapter's requests at a time."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()  # type: ignore[arg-type]
    model = PeftModel.from_pretrained(base, adapters[0].path, adapter_name=adapters[0].name)
    for adapter in adapters[1:]:
        model.load_adapter(adapter.path, adapter_name=adapter.name)
    model.eval()
    warm = torch.tensor([workload.prompts[0][:8]], device=device)
    model.generate(input_ids=warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False)
    outputs: list[list[int]] = [[] for _ in workload.prompts]
    _sync(device)
    start = time.perf_counter()
    for adapter in adapters:
        rows = [i for i, a in enumerate(assignment) if a is adapter]
        if not rows:
            continue
        model.set_adapter(adapter.name)
        from pagedq.bench.engine.workload import left_padded

        ids, mask = left_padded([workload.prompts[i] for i in rows])
        longest = max(workload.output_lens[i] for i in rows)
        with torch.inference_mode():
            generated = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                min_new_tokens=longest, do_sample=False, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        for row, i in enumerate(rows):
            outputs[i] = generated[row, ids.shape[1] : ids.shape[1] + workload.output_lens[i]].tolist()
    _sync(device)
    return time.perf_counter() - start, outputs, model


def _near_tie(model: Any, prompt: list[int], output: list[int], adapter: Adapter, step: int, device: str) -> float:
    """PEFT's gap between its top two logits at `step` of `output` for `prompt` run alone (no padding)."""
    import torch

    model.set_adapter(adapter.name)
    ids = torch.tensor([prompt + output[:step]], device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def compare(
    engine_outputs: list[list[int]], peft_outputs: list[list[int]], workload: Workload,
    assignment: list[Adapter | None], model: Any, device: str,
) -> dict:  # fmt: skip
    """Exact requests, and for each other its first differing step and PEFT's top-2 logit gap there (alone): a
    gap under 1e-4 is a near-tie that summation order decides (tests/engine/parity.py's rule)."""
    diverged = []
    for i, (ours, theirs) in enumerate(zip(engine_outputs, peft_outputs)):
        if ours == theirs:
            continue
        step = next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        adapter = assignment[i]
        assert adapter is not None
        gap = _near_tie(model, workload.prompts[i], theirs, adapter, step, device)
        diverged.append({"request": i, "step": step, "peft_top2_gap": gap})
    return {
        "exact_requests": len(engine_outputs) - len(diverged),
        "requests": len(engine_outputs),
        "near_ties": sum(d["peft_top2_gap"] < 1e-4 for d in diverged),
        "diverged": diverged,
        "outputs_exact": all(d["peft_top2_gap"] < 1e-4 for d in diverged),
    }


def run(args: argparse.Namespace) -> dict:

    import torch

    from pagedq.bench.engine.workload import draw_workload
    from pagedq.engine.config.engine import ModelConfig
    from pagedq.engine.demo_model import demo_model_path

    model_dir = args.model or str(demo_model_path())
    engine_kwargs = engine_kwargs_from(args, exclude=OWN_FLAGS)
    if args.rank[0] < 1:
        raise SystemExit(f"pagedq bench lora: --rank must be positive, got {args.rank[0]}:{args.rank[1]}")
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    # One workload per round (a fresh draw, so no round finds the previous one's prompts in the prefix cache);
    # base and lora run each round back to back, so a machine whose load drifts skews both alike.
    workloads = [
        draw_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed + r)
        for r in range(args.rounds)
    ]
    result: dict[str, Any] = {
        "bench": "lora", "date": time.strftime("%Y-%m-%d"), "model": Path(model_dir).name,
        "num_prompts": args.num_prompts, "num_adapters": args.num_adapters, "rank": list(args.rank),
        "input_len": list(args.input_len), "output_len": list(args.output_len), "rounds": args.rounds,
        "output_tokens": workloads[0].num_output_tokens, "torch": torch.__version__,
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pagedq-bench-lora-") as folder:
        adapters = write_adapters(model_dir, Path(folder), args.num_adapters, args.rank, args.seed)
        assignment: list[Adapter | None] = [adapters[i % len(adapters)] for i in range(args.num_prompts)]
        warm = workloads[0].prompts[0][:8]
        base = EngineUnderTest(model_dir, engine_kwargs, [], warm)
        lora_kwargs = dict(engine_kwargs, enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank[1])
        lora = EngineUnderTest(model_dir, lora_kwargs, adapters, warm)
        rounds = []
        for number, workload in enumerate(workloads):
            base_s, base_outputs = base.run(workload, [None] * args.num_prompts)
            lora_s, lora_outputs = lora.run(workload, assignment)
            rounds.append((workload.num_output_tokens / base_s, workload.num_output_tokens / lora_s))
            if number == 0:
                first_lora_s, first_lora_outputs = lora_s, lora_outputs
                # exactness against PEFT means something only where the adapter moved the output off the base's
                changed = sum(a != b for a, b in zip(lora_outputs, base_outputs))
        base.close()
        lora.close()
        result.update(
            base_output_tok_s=max(b for b, _ in rounds),
            lora_output_tok_s=max(lo for _, lo in rounds),
            lora_vs_base=statistics.median(lo / b for b, lo in rounds),
            lora_vs_base_rounds=[lo / b for b, lo in rounds],
            requests_changed_by_adapter=changed,
        )
        if args.baseline == "peft":  # on round 0's workload, against round 0's lora run
            result.update(
                _run_peft_baseline(model_dir, workloads[0], adapters, assignment, first_lora_outputs, first_lora_s)
            )
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
    return result


def _run_peft_baseline(
    model_dir: str, workload: Workload, adapters: list[Adapter], assignment: list[Adapter | None],
    lora_outputs: list[list[int]], lora_s: float,
) -> dict:  # fmt: skip
    try:
        import peft
    except ImportError:
        return {"peft": "not installed: pip install 'pagedq[test]' (or peft) for the transformers + PEFT baseline"}
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    peft_s, peft_outputs, model = run_peft(model_dir, workload, adapters, assignment, device)
    return {
        "peft": peft.__version__,
        "peft_output_tok_s": workload.num_output_tokens / peft_s,
        "lora_vs_peft": peft_s / lora_s,
        **compare(lora_outputs, peft_outputs, workload, assignment, model, device),
    }


def _sync(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(json.dumps(result))
    return 0
