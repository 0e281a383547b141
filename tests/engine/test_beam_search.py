"""Beam search against transformers' generate(num_beams=w, do_sample=False) on random-weight checkpoints."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedq.engine import LLM, BeamSearchParams, SamplingParams
from tests.conftest import VOCAB_SIZE

MAX_TOKENS = 10


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (5, 30)]


def _hf_beams(
    model, prompt: list[int], width: int, eos: int | None, early_stopping, length_penalty: float
) -> tuple[list, list]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=MAX_TOKENS,
        early_stopping=early_stopping,
        length_penalty=length_penalty,
        eos_token_id=eos,
        pad_token_id=eos if eos is not None else 0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    beams = []
    for sequence in out.sequences:
        generated = sequence[len(prompt) :].tolist()
        if eos is not None and eos in generated:  # transformers pads finished beams with pad (= eos here)
            generated = generated[: generated.index(eos) + 1]
        beams.append(generated)
    return beams, out.sequences_scores.tolist()


def _likely_token(llm: LLM, prompt: list[int]) -> int:
    """The model's first greedy token for `prompt`, made the EOS so that beams really end early."""
    return llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0].outputs[0].token_ids[0]


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_beam_search_matches_transformers(checkpoint_factory, architecture):
    folder = checkpoint_factory(architecture)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, num_kv_blocks=128)
    prompts = _prompts()
    eos = _likely_token(llm, prompts[0])
    llm.llm_engine.model_config.eos_token_ids = (eos,)
    finished_early = 0
    for width in (2, 4):
        # length_penalty 0 ranks by plain sums, so beams that end early on EOS win places in the result.
        for ignore_eos, early_stopping, penalty in (
            (True, False, 1.0),
            (False, False, 0.0),
            (False, True, 0.0),
            (False, "never", 1.0),
        ):
            params = BeamSearchParams(
                beam_width=width,
                max_tokens=MAX_TOKENS,
                ignore_eos=ignore_eos,
                early_stopping=early_stopping,
                length_penalty=penalty,
            )
            outputs = llm.beam_search(prompts, params)
            for prompt, output in zip(prompts, outputs):
                expected, scores = _hf_beams(hf, prompt, width, None if ignore_eos else eos, early_stopping, penalty)
                assert [s.token_ids for s in output.sequences] == expected, (width, ignore_eos, early_stopping)
                assert [s.score for s in output.sequences] == pytest.approx(scores, abs=1e-4)
                finished_early += sum(s.finish_reason == "stop" for s in output.sequences)
    assert finished_early > 0, "no beam ever ended on EOS: the EOS paths went untested"
    assert llm.llm_engine.num_free_blocks == 128


def test_beams_share_prefix_blocks(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_kv_blocks=64, block_size=16, enable_prefix_caching=False)
    engine = llm.llm_engine
    prompt = _prompts()[1] * 3  # 90 tokens: 5 full blocks + 10
    from pagedq.engine.beam_search import BeamSearchParams as Params

    engine.add_beam_search_request("b", prompt, Params(beam_width=4, max_tokens=8, ignore_eos=True))
    peak_used, peak_refs = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        used = engine.num_total_blocks - engine.num_free_blocks
        if used > peak_used:
            peak_used, peak_refs = used, used + engine.stats()["blocks_saved_by_sharing"]
    # Four beams of up to 98 tokens would need 4 * 7 = 28 blocks unshared; they share the 5 prompt blocks.
    assert peak_used <= 5 + 4 * 2
    assert peak_refs >= 4 * 6
    assert engine.num_free_blocks == 64


def test_bad_beam_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")


@pytest.mark.parametrize("prefix_caching,mode", [(True, "recompute"), (True, "swap"), (False, "recompute")])
def test_beam_groups_under_memory_pressure_finish_and_match_a_roomy_run(tiny_llama_dir, prefix_caching, mode):
    """Four width-4 groups in a pool that holds about one at a time: groups are preempted and readmitted whole
    (a beam left running while its siblings wait would hold blocks and never advance: the engine used to hang)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(10, 20))] for _ in range(4)]
    params = BeamSearchParams(beam_width=4, max_tokens=24, ignore_eos=True)
    roomy = LLM(tiny_llama_dir, num_kv_blocks=512, block_size=4).beam_search(prompts, params)
    tight = LLM(
        tiny_llama_dir,
        num_kv_blocks=32 if prefix_caching else 48,
        block_size=4,
        max_num_batched_tokens=24,
        enable_prefix_caching=prefix_caching,
        preemption_mode=mode,
        swap_space_gib=0.01,
    )
    outputs = tight.beam_search(prompts, params)
    assert tight.stats()["num_preemptions"] >= 8
    assert [[s.token_ids for s in o.sequences] for o in outputs] == [[s.token_ids for s in o.sequences] for o in roomy]
    assert tight.llm_engine.num_free_blocks == tight.llm_engine.num_total_blocks


def test_a_beam_group_that_could_never_run_whole_is_refused(tiny_llama_dir):
    engine = LLM(tiny_llama_dir, num_kv_blocks=20, block_size=4, max_num_seqs=8).llm_engine
    prompt = list(range(3, 19))  # 16 tokens: 4 full blocks, shared; each beam then needs 24 / 4 = 6 of its own
    with pytest.raises(ValueError, match="needs up to 28 KV blocks at once but the whole cache has 20"):
        engine.add_beam_search_request("wide", prompt, BeamSearchParams(beam_width=4, max_tokens=24))
    with pytest.raises(ValueError, match="beam_width 16 exceeds max_num_seqs"):
        engine.add_beam_search_request("wider", prompt, BeamSearchParams(beam_width=16, max_tokens=2))
    engine.add_beam_search_request("fits", prompt, BeamSearchParams(beam_width=2, max_tokens=24))  # 4 + 2 * 6
    assert not engine.output_processor.groups and set(engine.beam_search.groups) == {"fits"}


def test_a_stuck_scheduler_raises_instead_of_spinning(tiny_llama_dir, monkeypatch):
    from pagedq.engine.core.scheduler import SchedulerOutput

    engine = LLM(tiny_llama_dir, num_kv_blocks=32).llm_engine
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4))
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: SchedulerOutput())
    with pytest.raises(RuntimeError, match="cannot advance any of 0 running and 1 waiting"):
        engine.step()
