"""The order of the stop checks, vLLM's rules (docs/engine.md, "The order of the stop checks"): a stop string
completed by the token that also reaches max_tokens, EOS on that token, a stop token on the same token as a stop
string, min_tokens equal to max_tokens, and include_stop_str_in_output. Oracle: the same seeded generation without
the stop conditions (SmolLM2 on issue 20's own example: tests/engine/test_demo_model.py)."""

from __future__ import annotations

import dataclasses

import pytest

from pagedq.engine import LLM, RequestOutputKind, SamplingParams

DELTA = RequestOutputKind.DELTA

PROMPT = "Numbers like 12345"
GREEDY = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)  # seeded: a varied, fixed text


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, num_kv_blocks=64, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def case(llm):
    """(k, stop, texts, token): the k-th generated token completes the stop string, first seen there; texts[j]
    is the text of the first j tokens; token is the k-th token."""
    outs = [llm.generate(PROMPT, dataclasses.replace(GREEDY, max_tokens=j))[0].outputs[0] for j in range(1, 25)]
    texts = ["", *(o.text for o in outs)]
    for k in range(3, 24):
        ids = outs[k - 1].token_ids
        if ids[-1] in ids[:-1] or not texts[k].startswith(texts[k - 1]) or len(texts[k]) == len(texts[k - 1]):
            continue  # the k-th token must be new (a stop id test) and add text
        for size in (3, 2):
            stop = texts[k][-size:]
            if stop.strip() and texts[k].find(stop) == len(texts[k]) - size:
                return k, stop, texts, ids[-1]
    pytest.fail(f"no stop string completed by one new token in {texts[-1]!r}")


def _run(llm, **fields) -> tuple:
    out = llm.generate(PROMPT, dataclasses.replace(GREEDY, **fields))[0].outputs[0]
    return out.text, out.finish_reason, out.stop_reason, len(out.token_ids)


def test_stop_string_on_the_last_allowed_token_is_cut_and_reports_stop(llm, case):
    k, stop, texts, _ = case
    cut = texts[k][: -len(stop)]
    assert _run(llm, max_tokens=k, stop=[stop]) == (cut, "stop", stop, k)
    assert _run(llm, max_tokens=k + 4, stop=[stop]) == (cut, "stop", stop, k)  # the same, with room to spare
    engine = llm.llm_engine
    engine.add_request("d", PROMPT, dataclasses.replace(GREEDY, max_tokens=k, stop=[stop], output_kind=DELTA))
    deltas = [o.outputs[0] for _ in range(4 * k) for o in engine.step() if o.request_id == "d"]
    assert "".join(d.text for d in deltas) == cut and deltas[-1].finish_reason == "stop"


def test_include_stop_str_in_output_keeps_it(llm, case):
    k, stop, texts, _ = case
    assert _run(llm, max_tokens=k, stop=[stop], include_stop_str_in_output=True) == (texts[k], "stop", stop, k)


def test_stop_token_on_the_same_token_as_a_stop_string_wins(llm, case):
    k, stop, texts, token = case
    # vLLM: the stop token ends the sequence, its text is left out, no stop string is searched after it
    assert _run(llm, max_tokens=k + 4, stop=[stop], stop_token_ids=[token]) == (texts[k - 1], "stop", token, k)
    kept = _run(llm, max_tokens=k + 4, stop=[stop], stop_token_ids=[token], include_stop_str_in_output=True)
    assert kept == (texts[k], "stop", token, k)


def test_min_tokens_equal_to_max_tokens_ignores_a_stop_string_on_the_last_token(llm, case):
    k, stop, texts, _ = case
    # vLLM searches stop strings only once more than min_tokens tokens exist: here never
    assert _run(llm, max_tokens=k, min_tokens=k, stop=[stop]) == (texts[k], "length", None, k)


def test_eos_on_the_token_that_reaches_max_tokens_reports_stop(llm):
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(max_tokens=1, temperature=0.0, logit_bias={eos: 100.0}, skip_special_tokens=False)
    assert eos in llm.llm_engine.model_config.eos_token_ids
    out = llm.generate(PROMPT, params)[0].outputs[0]
    # vLLM checks EOS before the length; the EOS token's text is left out even with skip_special_tokens=False
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([eos], "", "stop", None)
    kept = llm.generate(PROMPT, dataclasses.replace(params, include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == llm.get_tokenizer().decode([eos]) and kept.finish_reason == "stop"
