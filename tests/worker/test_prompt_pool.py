"""A large prompt is made off the loop thread (service/prompt_pool.py) and one too long by its characters is refused
before it is tokenised (protocol/prompt_size.py). Oracles: a real Redis; a tokenizer whose chat template stops on a
marked conversation until the test releases it (small jobs of another tenant must complete while it is held, which
they can only do if the engine keeps stepping); the calls made to the tokenizer; the same jobs made on the loop
thread, which must answer token for token alike."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pagedq.worker import Client
from pagedq.worker.protocol.prompt_size import COMPOSITION_FACTOR, max_chars_per_token
from pagedq.worker.testing.stub_engine import StubEngine, StubTokenizer

from .helpers import finals_by_id, run_burst, wait_for, worker_thread

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>"
    "{% endif %}"
)
MARKER = "HOLD-THE-TEMPLATE"
SCHEMA = {"type": "object", "properties": {"x": {"type": "string", "description": "d" * 2000}}}
TOOLS = [{"type": "function", "function": {"name": f"f{i}", "parameters": SCHEMA}} for i in range(20)]


class GatedTokenizer(StubTokenizer):
    """Renders a conversation holding MARKER only once the test releases it (or after 30 s, not to hang a test).
    Its gate is files, so that it holds in a prompt process too (the pool's processes get a copy of it)."""

    def __init__(self, chat_template: str, folder: Path) -> None:
        super().__init__(chat_template)
        self.entered, self.release = folder / "entered", folder / "release"

    def apply_chat_template(self, messages: list[dict], **options: bool) -> str | list[int]:
        if any(MARKER in (m.get("content") or "") for m in messages):
            self.entered.touch()
            end = time.monotonic() + 30
            while not self.release.exists() and time.monotonic() < end:
                time.sleep(0.01)
        return super().apply_chat_template(messages, **options)


class ParentOnlyTokenizer(StubTokenizer):
    """Cannot be loaded in any process but the one that made it (a prompt process's start fails)."""

    def __init__(self, chat_template: str) -> None:
        super().__init__(chat_template)
        self.parent = os.getpid()

    def __setstate__(self, state: dict) -> None:
        if state["parent"] != os.getpid():
            raise RuntimeError("this tokenizer loads only where it was made")
        self.__dict__.update(state)


class CountingTokenizer(StubTokenizer):
    """Records the length of every text it encodes, and the conversations it renders."""

    def __init__(self, chat_template: str) -> None:
        super().__init__(chat_template)
        self.encoded: list[int] = []
        self.rendered: list[int] = []

    def apply_chat_template(self, messages: list[dict], **options: bool) -> str | list[int]:
        self.rendered.append(len(messages))
        return super().apply_chat_template(messages, **options)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append(len(text))
        return super().encode(text, add_special_tokens)


@pytest.mark.abuse
@pytest.mark.parametrize("pool", ["process", "thread"])
def test_small_jobs_run_while_a_large_prompt_is_made(redis_url, r, tmp_path, pool):
    engine = StubEngine(chat_template=TEMPLATE)
    tokenizer = engine.tokenizer = GatedTokenizer(TEMPLATE, tmp_path)
    client = Client(redis_url)
    # an earlier answer is not counted before rendering (a template may drop it): it is rendered, then refused
    turns = [{"role": "user", "content": MARKER}, {"role": "assistant", "content": "x" * 5000}]
    big = client.submit(messages=[*turns, {"role": "user", "content": "go on"}], max_tokens=4, tenant="a")
    try:
        with worker_thread(engine, redis_url, prompt_inline_chars=1000, prompt_pool=pool):
            wait_for(tokenizer.entered.exists, timeout=30, what="the large prompt's rendering")
            small = [client.submit(prompt=f"hi {i}", max_tokens=2, tenant="b") for i in range(4)]
            answers = [client.result(job_id, timeout=20) for job_id in small]
            held_meanwhile = not tokenizer.release.exists()
            tokenizer.release.touch()
            refused = client.result(big, timeout=20)
    finally:
        tokenizer.release.touch()
    assert held_meanwhile and [a.status for a in answers] == ["completed"] * 4
    # the rendered conversation cannot fit the stub's 2048 tokens: refused by its characters, once
    assert refused.status == "rejected" and "maximum context length" in refused.error and "characters" in refused.error
    finals = finals_by_id(r)
    assert set(finals) == {big, *small} and all(len(records) == 1 for records in finals.values())


@pytest.mark.abuse
def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenising(redis_url, r):
    engine = StubEngine(chat_template=TEMPLATE)
    tokenizer = engine.tokenizer = CountingTokenizer(TEMPLATE)
    client = Client(redis_url)
    long_text = client.submit(prompt="y" * 1_000_000, max_tokens=4)
    long_chat = client.submit(messages=[{"role": "user", "content": "z" * 500_000}], max_tokens=4)
    many_turns = client.submit(messages=[{"role": "user", "content": "m"}] * 10_000, max_tokens=4)
    many_tools = client.submit(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=4)
    fits = client.submit(prompt="y" * 2000, max_tokens=48)  # 2000 + 48 = the stub's max length: it fits
    run_burst(engine, redis_url, prompt_pool="thread")  # the counts are taken in this process
    results = {job_id: client.result(job_id, timeout=5) for job_id in (long_text, long_chat, many_turns, many_tools)}
    for result in results.values():
        assert result.status == "rejected" and "maximum context length" in result.error, result.error
    assert "1000000 characters" in results[long_text].error
    assert client.result(fits, timeout=5).status == "completed"
    assert max(tokenizer.encoded) == 2000  # only the prompt that fits was tokenised
    assert tokenizer.rendered == []  # each conversation is too long by what any template writes of it: not rendered
    assert all(len(records) == 1 for records in finals_by_id(r).values())


def test_prompt_processes_that_cannot_start_give_way_to_threads(redis_url, r):
    engine = StubEngine(chat_template=TEMPLATE)
    engine.tokenizer = ParentOnlyTokenizer(TEMPLATE)
    client = Client(redis_url)
    job_id = client.submit(messages=[{"role": "user", "content": "a long question " * 100}], max_tokens=4)
    run_burst(engine, redis_url, prompt_inline_chars=100)  # made in the pool: two process pools break, then threads
    result = client.result(job_id, timeout=5)
    assert result.status == "completed", result.error
    assert [record["status"] for record in finals_by_id(r)[job_id]] == ["completed"]


def _answers(engine, redis_url: str, jobs: list[dict], **settings) -> list[tuple]:
    client = Client(redis_url)
    ids = client.submit_many(jobs)
    run_burst(engine, redis_url, **settings)
    results = [client.result(job_id, timeout=5) for job_id in ids]
    return [(r.status, r.token_ids, r.text, r.prompt_text, r.usage.prompt_tokens if r.usage else None) for r in results]


def test_prompts_made_in_the_pool_answer_as_those_made_on_the_loop(redis_url, tiny_llama_dir):
    jobs = [
        {"prompt": "The quick brown fox " * 20, "max_tokens": 6, "temperature": 0.0, "echo": True},
        {"prompt": "hello", "max_tokens": 6, "temperature": 0.0, "logprobs": 2},
        {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0.0},
    ]
    from pagedq.engine import LLMEngine  # here: a prompt process imports this module, and needs no torch

    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    on_loop = _answers(engine, redis_url, jobs)
    in_pool = _answers(engine, redis_url, jobs, prompt_inline_chars=0, prompt_pool="thread")  # every text prompt
    assert on_loop == in_pool and all(answer[0] == "completed" for answer in on_loop)


@pytest.mark.parametrize("pool", ["process", "thread"])
def test_chat_made_in_the_pool_answers_as_on_the_loop(redis_url, pool):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    jobs = [{"messages": chat, "max_tokens": 8, "seed": 7}, {"prompt": "plain text", "max_tokens": 8, "seed": 7}]
    on_loop = _answers(StubEngine(chat_template=TEMPLATE), redis_url, jobs)
    in_pool = _answers(StubEngine(chat_template=TEMPLATE), redis_url, jobs, prompt_inline_chars=0, prompt_pool=pool)
    assert on_loop == in_pool and all(answer[0] == "completed" for answer in on_loop)


@pytest.mark.parametrize(
    "text",
    [
        " " * 5000,
        "\n" * 3000 + "\t" * 3000,
        "abc" * 2000,
        "The quick brown fox jumps over the lazy dog. " * 100,
        "é" * 1000 + "\u0301" * 1000 + "日本語" * 500,
        "<s></s>" * 500,
    ],
)
def test_the_characters_per_token_bound_is_a_lower_bound_on_the_count(tiny_llama_dir, text):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    bound = max_chars_per_token(tokenizer)
    assert bound is not None and bound >= 1
    assert len(tokenizer.encode(text, add_special_tokens=False)) * bound >= len(text)


def test_a_bound_only_for_a_tokenizer_that_keeps_every_character():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    splitting = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    splitting.pre_tokenizer = pre_tokenizers.Whitespace()  # drops whitespace, and an unknown word is one token
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=splitting)) is None
    stripping = Tokenizer(models.BPE({"a": 0}, []))
    stripping.normalizer = normalizers.Strip()
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=stripping)) is None
    removing = Tokenizer(models.BPE({"a": 0}, []))
    removing.normalizer = normalizers.Replace(" ", "")
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=removing)) is None
    composing = Tokenizer(models.BPE({"a": 0, "ab": 1, "b": 2}, [("a", "b")]))
    composing.normalizer = normalizers.NFC()
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=composing)) == 2 * COMPOSITION_FACTOR
    sentencepiece = Tokenizer(models.BPE({"▁": 0, "a": 1, "▁a": 2}, [("▁", "a")], byte_fallback=True))
    sentencepiece.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=sentencepiece)) == 2
