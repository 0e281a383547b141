"""vLLM's offline-API surface on `LLM`: chat(), the generate() progress bar, and an idle engine's gauges."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedq.engine import LLM, LLMEngine, SamplingParams
from tests.conftest import random_tokens

# A template in the shape checkpoints ship (tokenizer_config.json's chat_template); it writes BOS itself.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "The quick brown fox"}],
    [{"role": "system", "content": "Redis streams carry jobs."}, {"role": "user", "content": "Paged attention"}],
]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, num_kv_blocks=64, block_size=16)


def _template_ids(tokenizer, conversation, template=None) -> list[int]:
    """transformers' own rendering and tokenization of a conversation (the oracle)."""
    ids = tokenizer.apply_chat_template(
        conversation, chat_template=template, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    return list(ids)


def test_chat_renders_each_conversation_with_the_chat_template(llm, monkeypatch):
    tokenizer = llm.get_tokenizer()
    monkeypatch.setattr(tokenizer, "chat_template", TEMPLATE, raising=False)
    outputs = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    expected_prompts = [_template_ids(tokenizer, c) for c in CONVERSATIONS]
    assert [o.prompt_token_ids for o in outputs] == expected_prompts
    assert expected_prompts[0].count(tokenizer.bos_token_id) == 1  # BOS once: written by the template, not doubled
    by_generate = llm.generate(expected_prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in by_generate]
    single = llm.chat(CONVERSATIONS[1], GREEDY, use_tqdm=False)  # one conversation, not a list of them
    assert len(single) == 1 and single[0].prompt_token_ids == expected_prompts[1]


def test_chat_without_a_template_names_the_problem_and_takes_one_explicitly(llm):
    assert not getattr(llm.get_tokenizer(), "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(CONVERSATIONS[0], GREEDY)
    outputs = llm.chat(CONVERSATIONS[0], GREEDY, chat_template=TEMPLATE, use_tqdm=False)
    assert outputs[0].prompt_token_ids == _template_ids(llm.get_tokenizer(), CONVERSATIONS[0], TEMPLATE)


def test_generate_progress_bar_on_request_and_off_by_default_without_a_terminal(llm, capsys):
    prompts = [random_tokens(10 + i, seed=i) for i in range(3)]
    llm.generate(prompts, GREEDY, use_tqdm=True)
    bar = capsys.readouterr().err
    assert "Processed prompts" in bar and "3/3" in bar and "100%" in bar and "toks/s" in bar
    llm.generate(prompts, GREEDY)  # captured stderr is not a terminal: no bar by default
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_an_idle_engine_reports_no_kv_slot_utilization(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=16, block_size=16)
    assert engine.kv_slot_utilization == 0.0
    assert engine.stats()["kv_slot_utilization"] == 0.0 and engine.stats()["mean_kv_slot_utilization"] == 0.0
    engine.add_request("a", random_tokens(20, seed=1), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    # 20 prompt tokens in 2 blocks of 16 (async scheduling may have reserved the next token's slot too)
    assert 20 / 32 <= engine.kv_slot_utilization <= 22 / 32
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_slot_utilization == 0.0  # the finished request's blocks are free (cached ones count as free)


def _docs_block(page: str, heading: str) -> str:
    """The first ```python block after a heading of a docs/ page."""
    text = (Path(__file__).resolve().parents[2] / "docs" / page).read_text()
    after = text[text.index(heading) :]
    start = after.index("```python\n") + len("```python\n")
    return after[start : after.index("```", start)]


def test_docs_memory_sharing_snippet_runs_and_shares(tiny_llama_dir):
    snippet = _docs_block("engine.md", "## Memory sharing").replace('"path/to/checkpoint"', repr(str(tiny_llama_dir)))
    namespace: dict = {}
    exec(compile(snippet, "docs/engine.md (memory sharing)", "exec"), namespace)  # it runs as written
    story, outs = namespace["story"], namespace["outs"]
    prompt_len = len(outs[0].prompt_token_ids)
    full_blocks = (prompt_len - 1) // 16  # the cache always leaves the last prompt token to compute
    assert full_blocks >= 2  # longer than a block: there is something to share
    assert outs[0].num_cached_tokens == 16 * full_blocks  # the best_of call found the prompt's blocks cached
    # The snippet's first call, alone, against the same four samples run with nothing shared.
    params = SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=64)
    shared = LLM(tiny_llama_dir)
    samples = shared.generate(story, params)[0].outputs
    full_blocks = prompt_len // 16  # forked samples share every full block of the prompt
    alone = LLM(tiny_llama_dir, enable_prefix_caching=False)
    singles = alone.generate(
        [story] * 4, [SamplingParams(temperature=0.8, seed=1 + i, max_tokens=64) for i in range(4)]
    )
    assert [s.token_ids for s in samples] == [o.outputs[0].token_ids for o in singles]
    assert shared.stats()["num_prefilled_tokens"] == prompt_len  # once, not 4 times
    assert alone.stats()["num_prefilled_tokens"] == 4 * prompt_len
    # the three extra samples reference the prompt's full blocks instead of holding copies
    assert shared.stats()["peak_used_blocks"] == alone.stats()["peak_used_blocks"] - 3 * full_blocks
