"""Flags of `pagedq bench gateway` (apart from pagedq/bench/worker/gateway.py, which imports the HTTP stack)."""

from __future__ import annotations

import argparse

from pagedq.worker.flags import Option, add_options

OPTIONS: tuple[Option, ...] = (
    Option("requests", int, 3000, "requests per throughput run", bounds={"ge": 1}),
    Option("concurrency", int, 16, "requests in flight in the throughput runs", bounds={"ge": 1}),
    Option("latency_requests", int, 300, "requests, one at a time, per latency run", bounds={"ge": 1}),
    Option("stream_requests", int, 300, "streamed requests per side", bounds={"ge": 1}),
    Option("stream_tokens", int, 32, "tokens per streamed request", bounds={"ge": 1}),
)


def add_args(p: argparse.ArgumentParser) -> None:
    add_options(p, OPTIONS)
