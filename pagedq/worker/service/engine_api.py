"""The engine types the worker needs, imported from pagedq/engine/ without pulling in torch.

pagedq/engine/__init__.py imports the model code (torch); the worker's queue layer, the stub engine and the
producer clients only need the plain dataclasses, so load those modules directly.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from pagedq.engine.errors import ContextLengthExceeded, RequestRejected, check_context_fits  # noqa: F401
from pagedq.engine.lora.request import LoRARequest
from pagedq.engine.output.outputs import CompletionOutput, RequestOutput  # noqa: F401
from pagedq.engine.sample.sampling_params import RequestOutputKind, SamplingParams  # noqa: F401


@runtime_checkable
class WorkerEngine(Protocol):
    """What the worker drives between its Redis round trips: engine.LLMEngine, worker.testing.stub_engine.StubEngine
    and worker.testing.faults.FaultyEngine (around either) implement it. Optional extras the worker reads when
    present: `tokenizer` (chat templates), `kv_slot_utilization`, `stats()`, and the adapter calls `add_lora`,
    `remove_lora` (service/loras.py) of an engine serving LoRA adapters.

    Admission asks the engine instead of mirroring its state: how many tokens a prompt is, how many KV
    blocks a request of that shape takes, and how many its waiting queue will take (num_free_blocks minus
    that is what is left for new requests)."""

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        lora: LoRARequest | None = None,
    ) -> None: ...

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

    @property
    def max_num_seqs(self) -> int: ...

    max_model_len: int  # the longest prompt + output it serves

    def num_prompt_tokens(self, prompt: str | list[int]) -> int: ...

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> int: ...

    @property
    def waiting_blocks_needed(self) -> int: ...


def require_engine(engine: object) -> None:
    """A TypeError naming what is passed as an engine and is not one (before anything is built around it)."""
    if not isinstance(engine, WorkerEngine):
        raise TypeError(f"{type(engine).__name__} does not implement worker.service.engine_api.WorkerEngine")
