"""Structured outputs through the engine on a tiny random-weight checkpoint: every token drawn under a mask is one an
independent GrammarMatcher replay allows, in every sampling mode, next to unconstrained rows it must not change;
the features it meets (n / best_of, preemption both ways, chunked prefill, prefix caching, min_tokens, max_tokens,
aborts) and every failure path (bad grammar, compile timeout, a refused token) end one request, never the engine."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch
import transformers

from pagedq.engine import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from tests.engine.structured_oracle import GrammarReplay, text_matches

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}, "tag": {"enum": ["fox", "dog"]}},
    "required": ["id", "ok", "tag"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    StructuredOutputsParams(json=SCHEMA),
    StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True),
    StructuredOutputsParams(regex=r"[0-9]{2,4}-(fox|dog)"),
    StructuredOutputsParams(choice=["red", "green", "blue"]),
    StructuredOutputsParams(grammar='root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'),
    StructuredOutputsParams(json_object=True),
]
MODES = [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=11),
    dict(temperature=0.8, seed=5, top_k=20, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, seed=7, repetition_penalty=1.3, presence_penalty=0.5, logprobs=2),
]
PROMPTS = ["The quick brown fox", "Paged attention stores the key", "Redis streams carry jobs", "Numbers like 12345"]


def workload(max_tokens: int = 24) -> list[tuple[str, SamplingParams]]:
    """Every constraint in every sampling mode, with an unconstrained request after each constraint."""
    jobs = []
    for i, constraint in enumerate(CONSTRAINTS):
        for j, mode in enumerate(MODES):
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            jobs.append((prompt, SamplingParams(max_tokens=max_tokens, structured_outputs=constraint, **mode)))
        jobs.append((PROMPTS[i % 4], SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True)))
    return jobs


def run(model_dir, jobs, **engine_kwargs):
    llm = LLM(model_dir, max_num_seqs=engine_kwargs.pop("max_num_seqs", 32), **engine_kwargs)
    return llm, llm.generate([p for p, _ in jobs], [s for _, s in jobs])


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def check_against_replay(llm, jobs, outputs) -> None:
    engine = llm.llm_engine
    replay = GrammarReplay(engine.tokenizer, engine.model_config.vocab_size)
    stops = list(engine.model_config.eos_token_ids)
    for (_, params), output in zip(jobs, outputs):
        constraint = params.structured_outputs
        assert output.error is None, output.error
        for completion in output.outputs:
            if constraint is None:
                continue
            assert replay.refused(constraint, completion.token_ids, stops) == [], (constraint, completion)
            if completion.finish_reason == "stop":
                assert replay.is_complete(constraint, completion.token_ids, stops)
                assert text_matches(constraint, completion.text), completion.text
            else:
                assert completion.finish_reason == "length" and len(completion.token_ids) == params.max_tokens


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir):
    jobs = workload()
    llm, outputs = run(tiny_llama_dir, jobs)
    return jobs, llm, outputs


def test_every_masked_token_is_allowed_and_unconstrained_rows_are_untouched(tiny_llama_dir, baseline):
    jobs, llm, outputs = baseline
    check_against_replay(llm, jobs, outputs)
    finished = [c.finish_reason for (_, p), o in zip(jobs, outputs) if p.structured_outputs for c in o.outputs]
    assert "stop" in finished  # some grammars complete within the budget: the completion path is exercised
    plain = [(p, s) for p, s in jobs if s.structured_outputs is None]
    _, alone = run(tiny_llama_dir, plain)
    assert tokens(alone) == [t for (_, s), t in zip(jobs, tokens(outputs)) if s.structured_outputs is None]


def test_async_and_sync_scheduling_give_identical_tokens(tiny_llama_dir, baseline):
    jobs, llm, outputs = baseline
    other = not llm.llm_engine.config.async_scheduling
    _, flipped = run(tiny_llama_dir, jobs, async_scheduling=other)
    assert tokens(flipped) == tokens(outputs)


def test_an_inline_device_queue_samples_masked_steps_behind_their_mask_and_keeps_the_tokens(tiny_llama_dir, baseline):
    """CUDA's execution model, on CPU: work launched inline on the engine thread; a masked step's work on a helper
    thread (on CUDA: its forward queued at once, its sampling once the host filled the mask), and what is launched
    while it waits queued behind it. Out of order, a step would read the previous one's tokens before they exist."""
    import threading

    from pagedq.engine.step.async_step import DeviceQueue

    jobs, _, outputs = baseline
    llm = LLM(tiny_llama_dir, max_num_seqs=32)
    runner = llm.llm_engine.model_runner
    runner.device_queue.close()
    runner.device_queue = DeviceQueue(torch.device("cpu"), inline=True)
    real, threads = runner._device_work, set()

    def recorded(step):
        threads.add(threading.current_thread().name.split("_")[0])
        return real(step)

    runner._device_work = recorded
    assert tokens(llm.generate([p for p, _ in jobs], [s for _, s in jobs])) == tokens(outputs)
    assert "pagedq-device-wait" in threads
    threads.clear()
    plain = [(i, p, s) for i, (p, s) in enumerate(jobs) if s.structured_outputs is None]
    again = llm.generate([p for _, p, _ in plain], [s for _, _, s in plain])
    assert tokens(again) == [tokens(outputs)[i] for i, _, _ in plain] and threads == {"MainThread"}  # inline


def test_work_launched_behind_a_waiting_step_runs_after_it():
    """The inline queue's order: what is submitted while a step waits for its mask runs after that step, not inline
    before it (on CUDA: the next forward would read the draws the waiting step has not sampled yet)."""
    import threading

    from pagedq.engine.step.async_step import DeviceQueue, DeviceResult

    queue, mask_filled, order = DeviceQueue(torch.device("cpu"), inline=True), threading.Event(), []

    def masked():
        mask_filled.wait(10)
        order.append("masked")
        return DeviceResult(None)

    waiting = queue.submit(masked, waits=True)
    behind = queue.submit(lambda: order.append("behind") or DeviceResult(None))
    assert not waiting.done() and not behind.done() and order == []
    mask_filled.set()
    behind.result()
    assert order == ["masked", "behind"] and waiting.done()
    queue.submit(lambda: order.append("inline") or DeviceResult(None))  # drained: runs on the caller, at once
    assert order[-1] == "inline"
    queue.close()


def test_the_launched_steps_mask_fills_before_the_batch_is_post_processed(tiny_llama_dir):
    """Async: the matchers take a step's tokens before the batch's appends, stop checks and reports, and the
    launched step's mask starts filling then, so that step's sampling waits for the matchers alone (vLLM #26866).
    The tokens stay those of the sync run, stop strings and lengths included."""
    jobs = [
        (p, SamplingParams(max_tokens=12 + i, temperature=0.0, structured_outputs=c))
        for i, (p, c) in enumerate(zip(PROMPTS, CONSTRAINTS))
    ]
    jobs += [(p, SamplingParams(max_tokens=10, temperature=1.0, seed=3, stop=["e"])) for p in PROMPTS]
    llm = LLM(tiny_llama_dir, max_num_seqs=8, async_scheduling=True)
    engine, manager = llm.llm_engine, llm.llm_engine.structured
    post_step, seen = engine.post_step.run, []

    def watching(output, result):
        seen.append((len(manager.filler.pending), len(manager.filler.filling)))
        return post_step(output, result)

    engine.post_step.run = watching
    outputs = llm.generate([p for p, _ in jobs], [s for _, s in jobs])
    assert all(pending == 0 for pending, _ in seen)  # no launched step's mask waited for the processing
    assert sum(filling > 0 for _, filling in seen) >= 8  # its fill was under way during it
    _, synced = run(tiny_llama_dir, jobs, async_scheduling=False)
    assert tokens(outputs) == tokens(synced)
    check_against_replay(llm, jobs, outputs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_chunked_prefill_and_no_prefix_cache_keep_the_tokens(tiny_llama_dir, baseline, mode):
    jobs, _, outputs = baseline
    tight = dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=12, preemption_mode=mode)
    llm, squeezed = run(tiny_llama_dir, jobs, enable_prefix_caching=mode == "swap", **tight)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert tokens(squeezed) == tokens(outputs)


def test_n_and_best_of_give_each_sample_its_own_matcher(tiny_llama_dir):
    regex = StructuredOutputsParams(regex=r"[a-z]{3,6} [0-9]{1,3}")
    jobs = [
        (PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=16, structured_outputs=regex)),
        (PROMPTS[1], SamplingParams(n=2, best_of=4, temperature=1.0, seed=4, max_tokens=16, structured_outputs=regex)),
    ]
    llm, outputs = run(tiny_llama_dir, jobs)
    check_against_replay(llm, jobs, outputs)
    assert [len(o.outputs) for o in outputs] == [3, 2]
    assert len({tuple(c.token_ids) for c in outputs[0].outputs}) > 1  # the samples differ, each one valid
    assert not llm.llm_engine.structured.sequences and not llm.llm_engine.structured.grammars


def test_min_tokens_cannot_hold_a_finished_grammar_and_max_tokens_cuts_to_length(tiny_llama_dir):
    choice = StructuredOutputsParams(choice=["red", "green", "blue"])
    jobs = [
        (PROMPTS[0], SamplingParams(temperature=0.0, min_tokens=12, max_tokens=20, structured_outputs=choice)),
        (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=CONSTRAINTS[0])),
    ]
    _, (chosen, cut) = run(tiny_llama_dir, jobs)
    assert chosen.outputs[0].finish_reason == "stop" and chosen.outputs[0].text in choice.choice  # EOS wins
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.outputs[0].text)


def test_padded_vocab_ids_are_never_drawn(tiny_llama_dir, tmp_path):
    """A model whose vocab exceeds its tokenizer's: +100 logit bias on every padded id still never draws one."""
    config = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
    tokenizer_size = config.vocab_size
    config.vocab_size = tokenizer_size + 64
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_llama_dir / name).exists():
            shutil.copy(tiny_llama_dir / name, tmp_path / name)
    bias = {t: 100.0 for t in range(tokenizer_size, tokenizer_size + 64)}
    jobs = [(PROMPTS[0], SamplingParams(max_tokens=12, logit_bias=bias, structured_outputs=c)) for c in CONSTRAINTS]
    jobs.append((PROMPTS[1], SamplingParams(max_tokens=4, logit_bias=bias, ignore_eos=True)))
    llm, outputs = run(tmp_path, jobs)
    check_against_replay(llm, jobs[:-1], outputs[:-1])
    assert all(t < tokenizer_size for o in outputs[:-1] for t in o.outputs[0].token_ids)
    assert all(t >= tokenizer_size for t in outputs[-1].outputs[0].token_ids)  # the bias does work unmasked


BAD_SPECS = [
    ({"json": {"type": "no-such-type"}}, 'json does not compile: Unsupported type "no-such-type"'),
    (
        {"json": {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "no-such-type"}}}}},
        'json does not compile: Unsupported type "no-such-type"',
    ),
    (
        {"json": json.dumps({"anyOf": [{"type": "string"}, {"type": "no-such-type"}]})},
        'json does not compile: Unsupported type "no-such-type"',
    ),
    ({"regex": "([a-z"}, "regex does not compile: Regex parsing error at position 6: Unclosed '['"),
    ({"grammar": "root ::= nope"}, 'grammar does not compile: EBNF parser error at line 1, column 10: Rule "nope"'),
]


@pytest.mark.parametrize("spec, words", BAD_SPECS, ids=["json", "nested", "text", "regex", "grammar"])
def test_a_spec_that_does_not_convert_is_a_value_error_when_added(tiny_llama_dir, spec, words, monkeypatch):
    """vLLM's backend validates the schema at input processing: LLM.generate raises ValueError naming the problem,
    where it returned an empty output with finish reason abort; the engine is left clean, no compile started."""
    llm = LLM(tiny_llama_dir, num_kv_blocks=32)
    compiles = []
    monkeypatch.setattr(llm.llm_engine.structured.pool, "submit", lambda *args: compiles.append(args))
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    bad = SamplingParams(max_tokens=8, structured_outputs=spec)
    with pytest.raises(ValueError, match=re.escape(f"structured_outputs {words}")):
        llm.generate([PROMPTS[0], PROMPTS[1]], [plain, bad])
    assert compiles == [] and not llm.llm_engine.has_unfinished_requests()
    monkeypatch.undo()
    assert llm.generate(PROMPTS[1], plain)[0].outputs[0].finish_reason == "length"  # and it serves on


def test_a_compile_timeout_ends_only_its_request(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, structured_outputs_compile_timeout_s=30.0)
    good = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["ab"]))
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([PROMPTS[0]] * 2, [good, plain])
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop", "length"]
    assert outputs[0].outputs[0].text == "ab" and outputs[0].error is None and outputs[1].error is None

    slow = LLM(tiny_llama_dir, structured_outputs_compile_timeout_s=1e-6)
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(40)}}
    timed_out, served = slow.generate(
        [PROMPTS[0], PROMPTS[1]], [SamplingParams(max_tokens=8, structured_outputs={"json": schema}), plain]
    )
    assert timed_out.outputs[0].finish_reason == "abort"
    assert timed_out.error == "structured_outputs grammar did not compile within 1e-06 s"
    assert served.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="structured_outputs_compile_timeout_s must be > 0"):
        LLMEngine(tiny_llama_dir, structured_outputs_compile_timeout_s=0)


def test_a_refused_token_ends_that_request_with_an_error_and_aborts_free_matchers(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir)
    regex = StructuredOutputsParams(regex=r"[a-z ]{4,40}")
    engine.add_request("victim", PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=regex))
    engine.add_request("other", PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=regex))
    engine.add_request("gone", PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=regex))
    finals = {}
    while "victim" not in engine.structured.sequences:
        engine.step()
    # Fault injection: the victim's matcher now expects a grammar its tokens cannot follow.
    state = engine.structured.sequences["victim"]
    other_grammar = engine.structured.pool.compile(StructuredOutputsParams(regex="Z{50}"))
    state.matcher = type(state.matcher)(other_grammar)
    state.num_accepted = 0
    assert engine.abort_request("gone") is not None and "gone" not in engine.structured.sequences
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert finals["victim"].outputs[0].finish_reason == "abort"
    assert "does not match the structured_outputs grammar" in finals["victim"].error
    assert finals["other"].error is None and finals["other"].outputs[0].finish_reason in ("stop", "length")
    assert not engine.structured.sequences and not engine.structured.grammars and not engine.structured.errors


def test_a_steps_tokens_are_accepted_in_one_batch_as_one_by_one(tiny_llama_dir):
    """feed_all (a decode step's one new token per sequence, in one xgrammar call) against an independent matcher
    per sequence: the same accepted and refused tokens, the same error."""
    import xgrammar as xgr

    from pagedq.engine.structured_output.matcher import SequenceGrammar

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_regex("[a-z]+")
    outputs = [tokenizer.encode(text, add_special_tokens=False) for text in ("abc", "ab1", "x")]
    states = [SequenceGrammar(compiled, [], len(tokenizer)) for _ in outputs]
    for state, tokens in zip(states, outputs):
        assert state.feed(tokens[:-1]) is None
    errors = SequenceGrammar.feed_all(states, outputs)
    for tokens, error, state in zip(outputs, errors, states):
        oracle = xgr.GrammarMatcher(compiled)
        verdicts = [oracle.accept_token(t) for t in tokens]
        assert (error is None) == all(verdicts) and state.num_accepted == len(tokens) - (not verdicts[-1])
    assert errors[1] is not None and "does not match the structured_outputs grammar" in errors[1]


def test_requests_compiling_their_grammar_count_in_waiting_blocks_needed(tiny_llama_dir):
    """Admission (the worker's) reads waiting_blocks_needed: a request held for its grammar needs the blocks an
    unconstrained one waiting in the scheduler does, all its waves of samples included (n past max_num_seqs)."""
    counts = []
    for constraint in (CONSTRAINTS[0], None):
        engine = LLMEngine(tiny_llama_dir, max_num_seqs=2)
        for i, n in enumerate((1, 3)):
            params = SamplingParams(max_tokens=40, n=n, structured_outputs=constraint)
            engine.add_request(f"r{i}", PROMPTS[i] * 8, params)
        counts.append((engine.waiting_blocks_needed, engine.num_waiting_requests))
    assert counts[0] == counts[1] and counts[0][0] > 0 and counts[0][1] == 3  # r0, and r1 in two waves


def test_samplingparams_replace_keeps_the_constraint():
    params = SamplingParams(structured_outputs={"choice": ["a"]})
    assert dataclasses.replace(params, max_tokens=3).structured_outputs == params.structured_outputs


def test_a_failed_step_never_leaves_a_masked_step_waiting(tiny_llama_dir, monkeypatch):
    """Async: the step launched behind a failing one waits for a mask that will not come; it is cancelled, both are
    recomputed, and the structured request ends as an undisturbed run does."""
    params = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=CONSTRAINTS[2])
    expected = LLM(tiny_llama_dir).generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    engine = LLMEngine(tiny_llama_dir)
    runner = engine.model_runner
    real = runner._device_work
    calls = {"n": 0}

    def fails_on_the_fourth(step):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("device error")
        return real(step)

    monkeypatch.setattr(runner, "_device_work", fails_on_the_fourth)
    engine.add_request("r", PROMPTS[0], params)
    finals = {}
    with pytest.raises(RuntimeError, match="device error"):
        for _ in range(20):
            finals.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["r"].outputs[0].token_ids == expected and finals["r"].error is None


def test_a_fan_outs_draws_share_one_filled_row(tiny_llama_dir):
    """n / best_of: a request's first step draws several samples from its one matcher; its row is filled once and
    copied (xgrammar's batch fill would otherwise run one matcher on two threads at once)."""
    import xgrammar as xgr

    from pagedq.engine.structured_output.matcher import SequenceGrammar
    from pagedq.engine.structured_output.step_mask import StepMask

    engine = LLMEngine(tiny_llama_dir)
    compiled = engine.structured.pool.compile(CONSTRAINTS[0])
    sequences = {"a": SequenceGrammar(compiled, [2], 512), "b": SequenceGrammar(compiled, [2], 512)}
    assert sequences["b"].feed(engine.tokenizer.encode('{"id"')) is None
    mask = StepMask([0, 1, 2, 4], ["a", "a", "b", "a"], 5, 512)
    mask.fill(sequences, xgr.BatchGrammarMatcher(max_threads=2))
    alone = xgr.allocate_token_bitmask(2, 512)
    sequences["a"].fill_row(alone, 0)
    sequences["b"].fill_row(alone, 1)
    for row, source in ((0, 0), (1, 0), (2, 1), (4, 0)):
        assert torch.equal(mask.bitmask[row], alone[source])
    assert bool((mask.bitmask[3] == -1).all())  # an unstructured draw's row is left all-allowed
    assert mask.is_filled
