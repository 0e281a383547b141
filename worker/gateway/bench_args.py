"""Flags of `pagedq bench gateway` (apart from worker/gateway/bench.py, which imports the HTTP stack)."""

from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=3000, help="requests per throughput run")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight in the throughput runs")
    p.add_argument("--latency-requests", type=int, default=300, help="requests, one at a time, per latency run")
    p.add_argument("--stream-requests", type=int, default=300, help="streamed requests per side (default 300)")
    p.add_argument("--stream-tokens", type=int, default=32, help="tokens per streamed request")
