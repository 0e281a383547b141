"""The engine a `pagedq worker`, `demo` or `bench worker` runs, from its parsed flags: the real engine or the stub."""

from __future__ import annotations

import argparse
from typing import Any


def build_engine(args: argparse.Namespace) -> tuple[Any, str]:
    """The engine named by the arguments and the model name to report."""
    if args.engine == "stub":
        from pagedq.worker.testing.stub_engine import StubEngine

        limits = {"max_model_len": args.max_model_len} if args.max_model_len else {}
        engine = StubEngine(
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            step_delay_s=args.stub_step_delay,
            **limits,
        )
        return engine, "stub"
    from pagedq.engine import LLMEngine
    from pagedq.engine.options import engine_kwargs_from
    from pagedq.engine.startup import freeze_startup_objects

    model = args.model
    if model is None:
        from pagedq.engine.demo_model import demo_model_path

        model = str(demo_model_path())
    engine = LLMEngine(model, **engine_kwargs_from(args))
    freeze_startup_objects()  # a long-lived worker: keep the engine's start-up objects out of the cyclic GC
    return engine, str(model)


def engine_device(engine: Any, default: str) -> str:
    for owner in (engine, getattr(engine, "model_runner", None), getattr(engine, "config", None)):
        device = getattr(owner, "device", None)
        if device is not None:
            return str(device)
    return default
