"""LoRA adapters in the engine: the prefix cache keyed by adapter, unloading, the host cache, and the features that
run next to adapters (speculation, structured outputs, beams, n > 1) against PEFT or against the same request
alone."""

from __future__ import annotations

import random

import pytest
import torch

from pagedq.engine import LLM, BeamSearchParams, LLMEngine, LoRARequest, SamplingParams
from tests.conftest import VOCAB_SIZE
from tests.engine.lora_adapters import ALL, ATTENTION, MLP, peft_model, write_adapter
from tests.engine.parity import assert_greedy_parity, hf_greedy

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(checkpoint_factory, tmp_path_factory):
    checkpoint = checkpoint_factory("llama")
    folder = tmp_path_factory.mktemp("engine-adapters")
    shapes = [(ALL, 8), (ATTENTION, 4), (MLP, 8)]
    loras = [
        LoRARequest(f"e{i}", str(write_adapter(checkpoint, folder / f"e{i}", t, r, 2.0 * r, seed=20 + i)))
        for i, (t, r) in enumerate(shapes)
    ]
    return checkpoint, loras


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_the_prefix_cache_is_keyed_by_adapter(adapters):
    checkpoint, (a, b, _) = adapters
    prompt = _prompt(40, seed=1)  # two full blocks of 16 to share
    llm = LLM(checkpoint, enable_lora=True, max_loras=2, num_kv_blocks=32, enable_prefix_caching=True)
    uncached = LLM(checkpoint, enable_lora=True, max_loras=2, num_kv_blocks=32, enable_prefix_caching=False)
    first_a = llm.generate([prompt], GREEDY, lora_request=a)[0]
    assert first_a.num_cached_tokens == 0
    # computed under A: never served to B nor to the base model
    under_b = llm.generate([prompt], GREEDY, lora_request=b)[0]
    base = llm.generate([prompt], GREEDY)[0]
    assert under_b.num_cached_tokens == 0 and base.num_cached_tokens == 0
    again_a = llm.generate([prompt], GREEDY, lora_request=a)[0]
    again_base = llm.generate([prompt], GREEDY)[0]
    assert again_a.num_cached_tokens == 32 and again_base.num_cached_tokens == 32  # each from its own blocks
    expected = _tokens(uncached.generate([prompt] * 3, GREEDY, lora_request=[a, b, None]))
    assert _tokens([first_a, under_b, base]) == expected
    assert _tokens([again_a, again_base]) == [expected[0], expected[2]]
    # an adapter removed and added again under its name is a new adapter: the old one's blocks are not served
    llm.llm_engine.remove_lora(a.name)
    assert llm.generate([prompt], GREEDY, lora_request=a)[0].num_cached_tokens == 0


def test_removing_an_adapter_waits_for_the_requests_using_it(adapters):
    checkpoint, (a, b, _) = adapters
    prompt = _prompt(9, seed=2)
    expected = _tokens(LLM(checkpoint, enable_lora=True).generate([prompt], GREEDY, lora_request=a))
    engine = LLMEngine(checkpoint, enable_lora=True, max_loras=2, max_cpu_loras=2, num_kv_blocks=16)
    engine.add_request("r", prompt, GREEDY, lora=a)
    engine.step()
    engine.step()
    engine.remove_lora(a.name)
    assert [lora.name for lora in engine.list_loras()] == []  # gone for new requests at once
    assert engine.lora is not None and engine.lora.num_cached == 1  # ... but its weights stay for "r"
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    assert tokens == expected[0]
    engine.step()  # nothing left to run: the removal completes
    assert engine.lora.num_cached == 0 and engine.lora.slots.resident() == {}
    with pytest.raises(KeyError, match="no LoRA adapter named"):
        engine.remove_lora(a.name)
    engine.add_lora(b)
    assert [lora.name for lora in engine.list_loras()] == [b.name]


def test_the_host_cache_drops_the_least_recently_used_idle_adapter_and_reloads_it(adapters):
    checkpoint, loras = adapters
    prompt = _prompt(7, seed=3)
    expected = _tokens(LLM(checkpoint, enable_lora=True).generate([prompt] * 3, GREEDY, lora_request=loras))
    llm = LLM(checkpoint, enable_lora=True, max_loras=1, max_cpu_loras=2, num_kv_blocks=16)
    manager = llm.llm_engine.lora
    assert manager is not None
    for lora in loras:
        llm.llm_engine.add_lora(lora)
    assert manager.num_cached == 2 and manager.num_disk_loads == 3  # the first one was dropped
    assert [lora.name for lora in llm.llm_engine.list_loras()] == [lora.name for lora in loras]  # still registered
    # the dropped one is read again when a request names it, and drops the least recently used idle one
    assert _tokens(llm.generate([prompt], GREEDY, lora_request=loras[0])) == expected[:1]
    assert manager.num_disk_loads == 4 and manager.num_cached == 2
    # one slot for three adapters, all in use: each waits for the slot; none of them is dropped while it is
    # in use (the cache holds three until they finish)
    got = _tokens(llm.generate([prompt] * 3, GREEDY, lora_request=loras))
    assert got == expected
    assert manager.slots.num_loads == 3  # into the one slot: loras[0] (kept there), then the other two in turn
    stats = llm.stats()
    assert (stats["num_lora_slot_loads"], stats["num_lora_disk_loads"], stats["num_loras_loaded"]) == (3, 6, 3)


def _serve_stream(engine: LLMEngine, loras, arrivals) -> dict[str, tuple[int, int, int | None]]:
    """Run `arrivals` ({step: [adapter index or None, ...]}) to the end; per request (arrival step, admission step,
    adapter index). Admission is observed after the step that admitted it, so it reads one step late."""
    seen: dict[str, tuple[int, int, int | None]] = {}
    arrived: dict[str, tuple[int, int | None]] = {}
    rng = random.Random(11)
    params = SamplingParams(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True)
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for which in arrivals.get(step, ()):
            request_id = f"q{len(arrived)}"
            lora = None if which is None else loras[which]
            engine.add_request(request_id, _prompt(rng.randrange(2, 12), seed=len(arrived)), params, lora=lora)
            arrived[request_id] = (step, which)
        for request in engine.scheduler.running:
            if request.group_id not in seen:
                seen[request.group_id] = (*arrived[request.group_id], step)  # type: ignore[assignment]
        engine.step()
        step += 1
        assert step < 2000, "the stream did not drain"
    return {r: (a, admitted, which) for r, (a, which, admitted) in seen.items()}  # type: ignore[misc]


STREAM_TOKENS = 4
# A running request runs its prompt (< 12 tokens: one step) and STREAM_TOKENS decodes, and one more step in flight;
# admission is observed one step late.
LONGEST_RUN = 1 + STREAM_TOKENS + 1 + 1


def test_an_adapter_waiting_for_a_slot_is_admitted_within_the_bound(adapters):
    """Adapters 0 and 1 get a request every step, so both slots never empty; adapter 2's request still gets in
    within LORA_PASS_LIMIT schedules plus the longest run of the requests running when it was passed over for
    the last time (core/adapter_admission.py). Without the limit it would wait for the stream to end."""
    from pagedq.engine.core.adapter_admission import LORA_PASS_LIMIT

    checkpoint, loras = adapters
    engine = LLMEngine(checkpoint, enable_lora=True, max_loras=2, num_kv_blocks=128, max_num_seqs=16)
    stream_steps = 3 * LORA_PASS_LIMIT
    arrivals: dict[int, list[int | None]] = {step: [0, 1] for step in range(stream_steps)}
    arrivals[5] = [0, 1, 2]
    served = _serve_stream(engine, loras, arrivals)
    assert len(served) == 2 * stream_steps + 1  # every request was admitted, and the loop drained them all
    ((arrived, admitted, _),) = [v for v in served.values() if v[2] == 2]
    wait = admitted - arrived
    assert LORA_PASS_LIMIT <= wait <= LORA_PASS_LIMIT + LONGEST_RUN, wait  # held back, passed, then let in


def test_a_random_stream_over_more_adapters_than_slots_finishes_every_request_within_the_bound(adapters):
    """A seeded random stream of requests over three adapters and the base model, two slots, load below the
    engine's capacity: every request finishes, none waits past LORA_PASS_LIMIT plus the longest run twice over
    (one wait for its adapter, one behind a request held back ahead of it)."""
    from pagedq.engine.core.adapter_admission import LORA_PASS_LIMIT

    checkpoint, loras = adapters
    rng = random.Random(7)
    engine = LLMEngine(checkpoint, enable_lora=True, max_loras=2, num_kv_blocks=128, max_num_seqs=16)
    arrivals = {step: [rng.choice([0, 1, 2, None]) for _ in range(rng.randrange(0, 3))] for step in range(120)}
    served = _serve_stream(engine, loras, arrivals)
    assert len(served) == sum(map(len, arrivals.values()))
    waits = [admitted - arrived for arrived, admitted, _ in served.values()]
    assert max(waits) <= 2 * (LORA_PASS_LIMIT + LONGEST_RUN), max(waits)
    assert any(wait > 1 for wait in waits)  # the limit did hold requests back


def test_speculative_decoding_with_an_adapter_matches_peft(adapters):
    checkpoint, (a, _, _) = adapters
    oracle = peft_model(checkpoint, a.path)
    piece = _prompt(6, seed=4)
    prompt = piece * 4  # repeats: the n-gram proposer drafts
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    llm = LLM(checkpoint, enable_lora=True, num_kv_blocks=16, speculative_config=spec)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt, prompt], params, lora_request=[a, None])
    assert llm.stats()["num_draft_tokens"] > 0
    expected, logits = hf_greedy(oracle, prompt, 16)
    assert assert_greedy_parity(out[0].outputs[0].token_ids, expected, logits) == 0
    with oracle.disable_adapter():
        base, base_logits = hf_greedy(oracle, prompt, 16)
    assert assert_greedy_parity(out[1].outputs[0].token_ids, base, base_logits) == 0


def test_beam_search_with_an_adapter_matches_peft(adapters):
    checkpoint, (a, _, _) = adapters
    oracle = peft_model(checkpoint, a.path)
    prompt = _prompt(11, seed=5)
    llm = LLM(checkpoint, enable_lora=True, num_kv_blocks=32)
    ours = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6), lora_request=a)[0]
    out = oracle.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=3,
        num_return_sequences=3,
        do_sample=False,
        max_new_tokens=6,
        early_stopping=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert [s.token_ids for s in ours.sequences] == [s[len(prompt) :].tolist() for s in out]


def test_parallel_samples_fork_under_their_adapter(adapters):
    checkpoint, (a, b, _) = adapters
    prompt = _prompt(20, seed=6)
    oracle = peft_model(checkpoint, a.path)
    expected, logits = hf_greedy(oracle, prompt, 8)
    llm = LLM(checkpoint, enable_lora=True, max_loras=2, num_kv_blocks=32)
    greedy = llm.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True), lora_request=a)
    for sample in greedy[0].outputs:  # every fork computes under A, as the parent did
        assert assert_greedy_parity(sample.token_ids, expected, logits) == 0
    seeded = SamplingParams(n=2, best_of=3, max_tokens=8, temperature=0.9, seed=3, ignore_eos=True)
    alone = llm.generate([prompt], seeded, lora_request=b)[0]
    mixed = llm.generate([prompt, prompt], [seeded, GREEDY], lora_request=[b, a])[0]
    assert [s.token_ids for s in alone.outputs] == [s.token_ids for s in mixed.outputs]


def test_structured_outputs_under_an_adapter_equal_the_request_alone(adapters):
    from pagedq.engine import StructuredOutputsParams

    checkpoint, (a, b, _) = adapters
    regex = r"[a-z]{2,6} (fox|dog)"
    params = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=regex))
    llm = LLM(checkpoint, enable_lora=True, max_loras=2, num_kv_blocks=32)
    prompt = "the quick brown"
    alone = [llm.generate([prompt], params, lora_request=lora)[0].outputs[0].text for lora in (a, b, None)]
    mixed = [o.outputs[0].text for o in llm.generate([prompt] * 3, params, lora_request=[a, b, None])]
    assert alone == mixed
    import re

    assert all(re.fullmatch(regex, text) for text in mixed), mixed
