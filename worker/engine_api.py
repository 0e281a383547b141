"""The engine types the worker needs, imported from engine/ without pulling in torch.

engine/__init__.py imports the model code (torch); the worker's queue layer, the stub engine and the
producer clients only need the plain dataclasses, so load those modules directly.
"""

from __future__ import annotations

from engine.outputs import CompletionOutput, RequestOutput  # noqa: F401
from engine.sampling_params import RequestOutputKind, SamplingParams  # noqa: F401

from typing import Any, Protocol, runtime_checkable  # noqa: E402


@runtime_checkable
class WorkerEngine(Protocol):
    """What the worker drives between its Redis round trips: engine.LLMEngine, worker.stub_engine.StubEngine
    and worker.faults.FaultyEngine (around either) implement it. Optional extras the worker reads when
    present: `tokenizer` (chat templates), `block_size`, `kv_slot_utilization`, `stats()`."""

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0) -> Any: ...

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    @property
    def num_unfinished_requests(self) -> int: ...

    @property
    def num_waiting_requests(self) -> int: ...

    @property
    def num_running_requests(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_total_blocks(self) -> int: ...
