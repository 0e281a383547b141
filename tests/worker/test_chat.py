"""Chat jobs (`messages`): the worker renders them with the checkpoint's chat template. Oracle: the same
worker given the prompt that transformers' apply_chat_template makes answers token for token the same
(greedy), and the demo model knows the capital of France. A model without a chat template rejects them."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedq.engine import LLMEngine
from pagedq.worker import Client

from .helpers import worker_thread

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_chat_template_applied_on_the_demo_model(redis_url, demo_model_dir):
    engine = LLMEngine(str(demo_model_dir), device="cpu", num_kv_blocks=64)
    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_dir))
    templated = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    client = Client(redis_url)
    with worker_thread(engine, redis_url):
        chat = client.result(client.submit(messages=QUESTION, max_tokens=12, temperature=0), timeout=120)
        plain = client.result(client.submit(prompt=templated, max_tokens=12, temperature=0), timeout=120)
    assert chat.status == plain.status == "completed", (chat.error, plain.error)
    assert "Paris" in chat.text
    assert (chat.token_ids, chat.text) == (plain.token_ids, plain.text)
    # transformers tokenizes a rendered chat without adding special tokens (the template writes them)
    assert chat.usage.prompt_tokens == len(tokenizer(templated, add_special_tokens=False).input_ids)
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens


def test_model_without_chat_template_rejects_messages(redis_url, tiny_llama_dir):
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    assert not getattr(engine.tokenizer, "chat_template", None)
    client = Client(redis_url)
    with worker_thread(engine, redis_url):
        chat = client.result(client.submit(messages=QUESTION, max_tokens=4, metadata={"m": 1}), timeout=60)
        plain = client.result(client.submit(prompt="The quick brown fox", max_tokens=4), timeout=60)
    assert chat.status == "rejected" and "no chat template" in chat.error and chat.metadata == {"m": 1}
    assert plain.status == "completed"
