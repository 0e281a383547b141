"""The worker's engine interface (worker.service.engine_api.WorkerEngine) is what the engines really offer."""

from __future__ import annotations

import pytest
from redis import Redis

from pagedq.engine import LLMEngine
from pagedq.worker.assembly import Worker
from pagedq.worker.service.engine_api import WorkerEngine
from pagedq.worker.testing.faults import FaultyEngine
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import fast_settings


def test_every_engine_implements_the_protocol(tiny_llama_dir):
    real = LLMEngine(str(tiny_llama_dir), num_kv_blocks=32, device="cpu")
    for engine in (real, StubEngine(), FaultyEngine(StubEngine(), "X"), FaultyEngine(real, "X")):
        assert isinstance(engine, WorkerEngine), type(engine).__name__


def test_the_worker_refuses_an_engine_that_lacks_part_of_it():
    class NoStep:
        def add_request(self, *a, **k): ...

    with pytest.raises(TypeError, match="WorkerEngine"):
        Worker(NoStep(), Redis(), fast_settings())
