"""Issue 20's job fields through a real worker on SmolLM2, on both scheduling paths: the stop string completed by
the last allowed token, logit_bias, best_of, echo, and the token texts that records and deltas carry for the
tokenizer-free gateway. Oracles: the model's own tokenizer and the answer the issue quotes."""

from __future__ import annotations

import pytest
from redis import Redis
from transformers import AutoTokenizer

from pagedq.engine import LLMEngine
from pagedq.worker import Client
from pagedq.worker.ops.embedded_redis import EmbeddedRedis
from pagedq.worker.protocol.errors import JobRejected
from pagedq.worker.protocol.keys import QueueKeys

from .helpers import REDIS_SERVERS, worker_thread

pytestmark = pytest.mark.slow  # SmolLM2

QUESTION = "Question: 34 + 30 = ?\nAnswer:"  # greedy: " 34 + 30 = 64\n", the "\n" its 12th token


@pytest.fixture(scope="module", params=["async", "sync"])
def queue(request, demo_model_dir):
    """A Redis and one worker on SmolLM2, its engine on the async or the sync scheduling path."""
    binary = REDIS_SERVERS.get("redis-system") or next(iter(REDIS_SERVERS.values()))
    server = EmbeddedRedis(binary=binary, extra_args=("--save", "", "--appendonly", "no")).start()
    engine = LLMEngine(str(demo_model_dir), num_kv_blocks=64, async_scheduling=request.param == "async")
    try:
        with worker_thread(engine, server.url), Client(server.url) as client:
            yield client, server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return AutoTokenizer.from_pretrained(demo_model_dir)


def test_a_stop_string_on_the_last_allowed_token_is_cut_and_reports_stop(queue):
    client, _ = queue
    job_id = client.submit(QUESTION, max_tokens=12, temperature=0.0, stop=["\n"], stream=True)
    deltas = list(client.stream(job_id, timeout=60))
    record = client.result(job_id, timeout=60)
    assert (record.text, record.finish_reason, record.stop_reason) == (" 34 + 30 = 64", "stop", "\n")
    assert "".join(d.text for d in deltas) == record.text and len(record.token_ids) == 12


def test_records_and_deltas_name_their_tokens(queue, tokenizer):
    client, _ = queue
    job_id = client.submit("The capital of France is", max_tokens=8, temperature=0.0, logprobs=2, stream=True)
    deltas = list(client.stream(job_id, timeout=60))
    record = client.result(job_id, timeout=60)
    texts = record.token_texts
    assert texts is not None and "".join(texts[str(t)] for t in record.token_ids) == record.text
    named = {int(k) for e in record.logprobs for k in e} | set(record.token_ids)
    assert texts == {str(t): tokenizer.decode([t]) for t in named}
    for delta in deltas:
        assert {int(k) for e in delta.logprobs or () for k in e} | set(delta.token_ids) <= {
            int(k) for k in delta.token_texts
        }


def test_echo_carries_the_prompt_in_the_record_and_the_first_delta(queue, tokenizer):
    client, _ = queue
    ids = tokenizer.encode("Paged attention stores")
    job_id = client.submit(
        prompt_token_ids=ids, max_tokens=3, temperature=0.0, echo=True, prompt_logprobs=1, stream=True
    )
    first, *rest = list(client.stream(job_id, timeout=60))
    record = client.result(job_id, timeout=60)
    assert (record.prompt_token_ids, record.prompt_text) == (ids, tokenizer.decode(ids))
    assert (first.prompt_token_ids, first.prompt_text) == (ids, record.prompt_text)
    assert first.prompt_logprobs == record.prompt_logprobs and record.prompt_logprobs[0] is None
    assert all(d.prompt_token_ids is None for d in rest)
    assert all(str(t) in record.token_texts for t in ids)


def test_logit_bias_and_best_of_through_the_queue(queue, tokenizer):
    client, url = queue
    forced = tokenizer.encode(" banana")[0]
    job_id = client.submit("The capital of France is", max_tokens=4, temperature=0.0, logit_bias={forced: 100.0})
    assert client.result(job_id, timeout=60).token_ids == [forced] * 4
    best = client.result(
        client.submit("Once upon a time", max_tokens=6, best_of=3, seed=1, ignore_eos=True), timeout=60
    )
    assert best.ok and best.choices is None and len(best.token_ids) == 6
    with pytest.raises(JobRejected, match="best_of > n cannot stream"):
        client.submit("x", best_of=2, stream=True)
    with pytest.raises(JobRejected, match="logit_bias"):
        client.submit("x", logit_bias={forced: 100.5})
    published = Redis.from_url(url).hgetall(QueueKeys().tokenizer("unknown"))
    assert b"digest" in published and b"tokenizer.json" in published  # for the gateway's /tokenize
