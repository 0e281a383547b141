"""The engine's admission queries (num_prompt_tokens, blocks_needed, waiting_blocks_needed), checked against
what the block manager really allocates and what the tokenizer really makes, on the tiny checkpoint."""

from __future__ import annotations

import pytest

from pagedq.engine import LLMEngine, SamplingParams

BLOCK = 8


def engine_for(tiny_llama_dir, **kwargs) -> LLMEngine:
    return LLMEngine(str(tiny_llama_dir), device="cpu", block_size=BLOCK, num_kv_blocks=64, **kwargs)


def distinct_prompt(length: int, start: int) -> list[int]:
    return [start] + [3 + (start + i) % 90 for i in range(length - 1)]  # no shared prefix between cases


def peak_blocks(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> int:
    """The most KV blocks in use while the request runs alone (the block manager's count, taken by the engine
    right after each step is scheduled: a request can finish within the step that allocated its last block)."""
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.stats()["peak_used_blocks"]


@pytest.mark.parametrize("prompt_len, max_tokens", [(5, 3), (8, 8), (7, 1), (9, 15), (16, 17), (3, 30)])
def test_blocks_needed_is_what_a_request_holds_at_its_longest(tiny_llama_dir, prompt_len, max_tokens):
    engine = engine_for(tiny_llama_dir, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    peak = peak_blocks(engine, "r", distinct_prompt(prompt_len, 1), params)
    assert engine.blocks_needed(prompt_len, max_tokens) == peak


def test_blocks_needed_counts_shared_prompt_blocks_once_for_parallel_samples(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=3, ignore_eos=True)
    peak = peak_blocks(engine, "fan", distinct_prompt(19, 5), params)
    need = engine.blocks_needed(19, 12, n=3)
    assert peak <= need <= peak + 1, (peak, need)  # an upper bound, at most the copied partial block over
    assert need < 3 * engine.blocks_needed(19, 12)  # the prompt's full blocks are counted once


def test_waiting_blocks_needed_is_the_waiting_queues_demand(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir, max_num_seqs=1)
    shapes = {"a": (6, 4), "b": (13, 9), "c": (20, 2)}
    for n, (request_id, (prompt_len, max_tokens)) in enumerate(shapes.items()):
        engine.add_request(
            request_id,
            distinct_prompt(prompt_len, 10 * (n + 1)),
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
    assert engine.waiting_blocks_needed == sum(engine.blocks_needed(*s) for s in shapes.values())
    engine.step()  # one seat: "a" runs, the others wait
    assert engine.num_waiting_requests == 2
    assert engine.waiting_blocks_needed == engine.blocks_needed(*shapes["b"]) + engine.blocks_needed(*shapes["c"])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.waiting_blocks_needed == 0


def test_num_prompt_tokens_is_what_the_engine_makes_of_the_prompt(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    text = "the quick brown fox jumps over the lazy dog"
    engine.add_request("t", text, SamplingParams(max_tokens=1))
    out = [o for o in engine.step() + engine.step() if o.request_id == "t"]
    assert engine.num_prompt_tokens(text) == len(out[0].prompt_token_ids)
    assert engine.num_prompt_tokens([5, 6, 7]) == 3
    with pytest.raises(ValueError, match="empty"):
        engine.num_prompt_tokens("")
