"""Flags of `pagedq bench fleet` (apart from pagedq/bench/worker/fleet.py, which imports psutil and the client)."""

from __future__ import annotations

import argparse

from pagedq.worker.flags import Option, add_options

OPTIONS: tuple[Option, ...] = (
    Option("jobs", int, 600, "jobs per fault scenario", bounds={"ge": 8, "le": 1_000_000}),
    Option("throughput_jobs", int, 5000, "jobs per worker count in the throughput scenario", bounds={"ge": 1}),
    Option(
        "lease_ms", int, 2000, "the workers' lease: a killed worker's jobs are claimable after it", bounds={"ge": 100}
    ),
    Option(
        "step_delay", float, 0.02, "seconds per stub engine step in the fault scenarios", bounds={"ge": 0, "le": 10}
    ),
    Option("max_workers", int, 4, "the throughput scenario runs 1..this many workers", bounds={"ge": 1, "le": 16}),
    Option("repeats", int, 3, "runs per worker count in the throughput scenario; the best is kept", bounds={"ge": 1}),
    Option(
        "scenarios",
        str,
        "all",
        "faults: scale out, scale in, kill -9; throughput: jobs/s by worker count",
        choices=("all", "faults", "throughput"),
    ),
    Option("cluster", bool, False, "also run every scenario against a private 3-master Redis Cluster"),
)


def add_args(p: argparse.ArgumentParser) -> None:
    add_options(p, OPTIONS)
