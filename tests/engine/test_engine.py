"""Engine behaviour: seeds, stop conditions, logprobs, penalties, step API, aborts, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedq.engine import LLM, LLMEngine, RequestOutputKind, SamplingParams
from tests.conftest import random_tokens as _tokens
from tests.engine.helpers import stop_cut_after_min_tokens
from tests.engine.parity import assert_greedy_parity

PROMPTS = ["The quick brown fox", "Paged attention stores", "Numbers like 12345", "A scheduler batches"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, num_kv_blocks=64, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def test_same_seed_same_output_whatever_the_batch(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    in_batch = llm.generate(PROMPTS, params)[0].outputs[0].token_ids
    assert alone == in_batch
    other_seed = llm.generate(PROMPTS[0], dataclasses.replace(params, seed=43))[0].outputs[0].token_ids
    assert other_seed != alone
    unseeded = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]] * 2, dataclasses.replace(params, seed=None))]
    assert unseeded[0] != unseeded[1]


def test_seeded_output_survives_preemption(tiny_llama_dir):
    params = SamplingParams(max_tokens=32, temperature=0.9, seed=5, ignore_eos=True)
    roomy = LLM(tiny_llama_dir).generate(PROMPTS, params)
    tight_llm = LLM(tiny_llama_dir, num_kv_blocks=6, block_size=16, max_num_batched_tokens=16)
    tight = tight_llm.generate(PROMPTS, params)
    assert tight_llm.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


def test_stop_string_cuts_the_text(llm):
    base = llm.generate(PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].outputs[0]
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    assert stop.strip(), f"degenerate stop string from {base.text!r}"
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]))
    completion = out[0].outputs[0]
    assert completion.text == base.text[: base.text.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.token_ids == base.token_ids[: len(completion.token_ids)]


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate(PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].outputs[0]
    stop_token = base.token_ids[3]
    first = base.token_ids.index(stop_token)
    out = llm.generate(
        PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token])
    )[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    late = llm.generate(
        PROMPTS[2],
        SamplingParams(
            max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token], min_tokens=first + 2
        ),
    )[0].outputs[0]
    assert stop_token not in late.token_ids[: first + 2]


def test_stop_strings_wait_for_min_tokens(llm):
    base = llm.generate(PROMPTS[2], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0].outputs[0]
    stop, min_tokens = base.text[1:4], 5
    assert stop.strip() and stop in base.text[:4], f"degenerate stop string from {base.text!r}"
    prefix_text = llm.get_tokenizer().decode(base.token_ids[:min_tokens])
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=min_tokens)
    out = llm.generate(PROMPTS[2], params)[0].outputs[0]
    assert len(out.token_ids) > min_tokens
    assert out.text == stop_cut_after_min_tokens(base.text, prefix_text, stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == base.token_ids[: len(out.token_ids)]


def test_logprobs_match_log_softmax_of_transformers_logits(llm, hf_model):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3))[0]
    completion = out.outputs[0]
    sequence = torch.tensor([out.prompt_token_ids + completion.token_ids])
    with torch.no_grad():
        logits = hf_model(sequence).logits[0]
    n = len(out.prompt_token_ids)
    total = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        reference = torch.log_softmax(logits[n - 1 + step], dim=-1)
        top = reference.topk(3)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for token_id, logprob in entry.items():
            assert logprob == pytest.approx(reference[token_id].item(), abs=1e-4)
        total += reference[token].item()
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-3)


def _assert_prompt_logprobs_match(prompt: list[int], entries: list, hf_model, k: int) -> None:
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0], dim=-1)
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        assert set(entries[j]) == set(reference[j - 1].topk(k).indices.tolist()) | {prompt[j]}, j
        for token_id, logprob in entries[j].items():
            assert logprob == pytest.approx(reference[j - 1, token_id].item(), abs=1e-4)


def test_prompt_logprobs_match_transformers_under_chunking_caching_and_preemption(tiny_llama_dir, hf_model):
    prompts = [_tokens(n, seed=n) for n in (40, 35, 30)]
    # 8-token chunks; the first prompt's blocks are already cached (prompt log-probabilities skip the cache);
    # a pool that preempts prompts half computed (the entries of a recomputed prompt are not collected twice).
    llm = LLM(tiny_llama_dir, max_num_batched_tokens=8, num_kv_blocks=10, block_size=8)
    llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    outputs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0
    for prompt, output in zip(prompts, outputs):
        _assert_prompt_logprobs_match(prompt, output.prompt_logprobs, hf_model, 3)
    assert llm.generate(prompts[1], dataclasses.replace(params, prompt_logprobs=None))[0].prompt_logprobs is None


def test_prompt_logprobs_come_with_the_first_delta_only(tiny_llama_dir, hf_model):
    engine = LLMEngine(tiny_llama_dir)
    prompt = _tokens(12, seed=3)
    engine.add_request(
        "d",
        prompt,
        SamplingParams(
            max_tokens=5, prompt_logprobs=0, n=2, seed=1, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        ),
    )
    reports = [output.prompt_logprobs for output in _drain_all(engine)]
    assert len(reports) == 5 and all(report is None for report in reports[1:])
    _assert_prompt_logprobs_match(prompt, reports[0], hf_model, 0)


def test_repetition_penalty_matches_transformers(llm, hf_model):
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[3])
    out = llm.generate(
        [prompt_ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.5)
    )[0].outputs[0]
    hf = hf_model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=24,
        min_new_tokens=24,
        do_sample=False,
        repetition_penalty=1.5,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=0,
    )
    ties = assert_greedy_parity(out.token_ids, hf.sequences[0, len(prompt_ids) :].tolist(), [s[0] for s in hf.logits])
    assert ties == 0, f"{ties} near-ties where none were measured (see tests/engine/parity.py)"


def test_eos_stops_unless_ignored(tiny_llama_dir, llm):
    base = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0]
    engine = LLMEngine(tiny_llama_dir)
    engine.model_config.eos_token_ids = (base.token_ids[4],)
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0))
    final = _drain(engine)["r"]
    assert final.outputs[0].token_ids == base.token_ids[: base.token_ids.index(base.token_ids[4]) + 1]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason is None


def _drain_all(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def _drain(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def test_step_api_deltas_concatenate_to_the_final_output(tiny_llama_dir, llm):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=["zz-never"])
    expected = llm.generate(PROMPTS[1], params)[0].outputs[0]
    engine = LLMEngine(tiny_llama_dir)
    engine.add_request("d", PROMPTS[1], dataclasses.replace(params, output_kind=RequestOutputKind.DELTA))
    engine.add_request("c", PROMPTS[1], params)  # CUMULATIVE
    tokens, text, reports = [], "", 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == "d":
                tokens += output.outputs[0].token_ids
                text += output.outputs[0].text
                reports += 1
            else:
                assert output.outputs[0].token_ids == expected.token_ids[: len(output.outputs[0].token_ids)]
    assert tokens == expected.token_ids and text == expected.text and reports == 30


def test_abort_frees_blocks_and_returns_partial_output(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=32)
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))
    # With async scheduling a step's tokens are reported by the next call: one step fewer is finished.
    finished_steps = 5 - (engine._pipeline_depth - 1)
    reported_a = [o.outputs[0].token_ids for _ in range(5) for o in engine.step() if o.request_id == "a"]
    assert engine.num_free_blocks < 32
    final = engine.abort_request("a")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert final.outputs[0].token_ids == reported_a[-1] and len(reported_a[-1]) == finished_steps
    assert engine.abort_request("a") is None
    engine.add_request(
        "d", PROMPTS[2], SamplingParams(max_tokens=50, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    )
    reported = []
    for _ in range(4):
        reported += [t for o in engine.step() if o.request_id == "d" for t in o.outputs[0].token_ids]
    final_d = engine.abort_request("d")  # cumulative even for a DELTA request: the partial output, whole
    assert final_d.outputs[0].token_ids == reported and len(reported) == 4 - (engine._pipeline_depth - 1)
    engine.abort_request("b")
    assert engine.num_free_blocks == 32 and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(stop=[""]), "stop"),
        (dict(logprobs=-1), "logprobs"),
        (dict(max_tokens="3"), "max_tokens"),
        (dict(seed=1.5), "seed"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt,message",
    [
        ("", "empty"),
        ([], "empty"),
        ([1, 2, 10**6], r"token ids must be in \[0, 512\)"),
        ([1, -1], "token ids"),
        ([1, "x"], "list of integer"),
        (None, "string or a list"),
    ],
)
def test_bad_prompts_are_refused_and_leave_the_engine_serving(tiny_llama_dir, prompt, message):
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=16)
    engine.add_request("ok", PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=4))
    assert engine.num_unfinished_requests == 1
    assert len(_drain(engine)["ok"].outputs[0].token_ids) == 4


def test_requests_that_can_never_fit_are_refused(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=4, block_size=16)  # 64 slots in all; max length 512
    with pytest.raises(ValueError, match="maximum context length is 512 tokens"):
        engine.add_request("long", [5] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="needs 5 KV blocks but the whole cache has 4"):
        engine.add_request("big", [5] * 60, SamplingParams(max_tokens=20))
    engine.add_request("fits", [5] * 40, SamplingParams(max_tokens=24, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("fits", [5], SamplingParams())
    assert len(_drain(engine)["fits"].outputs[0].token_ids) == 24


def test_unsupported_architecture_is_named(tmp_path, tiny_llama_dir):
    import json
    import shutil

    shutil.copytree(tiny_llama_dir, tmp_path / "m", dirs_exist_ok=True)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"):
        LLM(tmp_path / "m")


def test_per_prompt_params_and_input_order(llm):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 1, 5)]
    outputs = llm.generate(PROMPTS, params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 9, 1, 5]
    assert [o.prompt for o in outputs] == PROMPTS


def test_step_phases_are_timed(tiny_llama_dir):
    import time

    engine = LLMEngine(tiny_llama_dir)
    engine.add_request("t", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    _drain(engine)
    wall_ms = 1e3 * (time.perf_counter() - started)
    stats = engine.stats()
    phases = [stats[f"{phase}_ms_per_step"] for phase in ("schedule", "execute", "postprocess")]
    assert stats["num_steps"] == 8 and all(ms > 0 for ms in phases)
    assert sum(phases) * stats["num_steps"] <= wall_ms
    engine.reset_step_stats()
    assert engine.stats()["num_steps"] == 0 and engine.stats()["execute_ms_per_step"] == 0


def test_constructing_an_engine_leaves_the_gc_alone(tiny_llama_dir):
    """A library constructor must not change process-wide state: the tests alone build dozens of engines."""
    import gc

    frozen, enabled, thresholds = gc.get_freeze_count(), gc.isenabled(), gc.get_threshold()
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=8)
    assert (gc.get_freeze_count(), gc.isenabled(), gc.get_threshold()) == (frozen, enabled, thresholds)
    assert engine.num_total_blocks == 8


def test_pagedq_generate_freezes_its_startup_objects(tiny_llama_dir, capsys):
    """The long-lived entry points (worker, generate, bench) are where gc.freeze belongs."""
    import gc

    from pagedq.engine.cli import main

    gc.unfreeze()
    try:
        assert (
            main(["generate", "--model", str(tiny_llama_dir), "--max-tokens", "2", "--num-kv-blocks", "8", "The quick"])
            == 0
        )
        assert gc.get_freeze_count() > 10_000  # torch, transformers and the model: nothing a collection should walk
    finally:
        gc.unfreeze()
    assert "### The quick" in capsys.readouterr().out
