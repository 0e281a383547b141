"""`pagedq demo`: an embedded Redis, a worker thread on the demo model, a few jobs (one streamed)."""

from __future__ import annotations

import argparse
import threading

from pagedq.worker.assembly import Worker
from pagedq.worker.client.sync_client import Client
from pagedq.worker.ops.embedded_redis import EmbeddedRedis
from pagedq.worker.protocol.connection import connect
from pagedq.worker.service.config import WorkerSettings

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
]


def _chat(tokenizer, question: str) -> str:
    """The instruct model answers best through its chat template; fall back to the bare question."""
    try:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
    except Exception:
        return question


def run_demo(args: argparse.Namespace) -> int:
    from pagedq.worker.cli.engine import build_engine

    print("loading the model (the demo model is converted once, about a minute, then cached)...", flush=True)
    engine, model = build_engine(args)
    with EmbeddedRedis() as server:
        settings = WorkerSettings(name="demo", block_ms=100, device=args.device, model=model)
        worker = Worker(engine, connect(server.url), settings)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            _produce(Client(server.url), engine.tokenizer, args.max_tokens, server.url)
        finally:
            worker.request_stop(drain_timeout_s=5)
            thread.join(timeout=30)
    return 0


def _produce(client: Client, tokenizer, max_tokens: int, redis_url: str) -> None:
    print(f"redis: {redis_url}  queue: {client.keys.queue}")  # a URL a second shell can connect to
    streamed = client.submit(
        prompt=_chat(tokenizer, QUESTIONS[0]),
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        metadata={"question": QUESTIONS[0]},
    )
    others = client.submit_many(
        [
            dict(prompt=_chat(tokenizer, q), max_tokens=max_tokens, temperature=0.0, metadata={"question": q})
            for q in QUESTIONS[1:]
        ]
    )
    print(f"\n[{QUESTIONS[0]}] (streamed)\n> ", end="", flush=True)
    for delta in client.stream(streamed, timeout=120):
        print(delta.text, end="", flush=True)
    print()
    for job_id in [streamed, *others]:
        res = client.result(job_id, timeout=300)
        print(
            f"\n[{(res.metadata or {}).get('question')}] status={res.status} finish={res.finish_reason} "
            f"tokens={res.usage.completion_tokens} ttft={res.timings.ttft}s total={res.timings.total}s"
        )
        print(f"> {res.text.strip()}")
