"""pagedq: an LLM inference worker fed from Redis, over a continuous-batching engine with a paged KV cache.

Three parts under this one import root, so that no other distribution can shadow them (Hugging Face's `kernels`,
which transformers requires, once did): `pagedq.engine` and `pagedq.kernels` (torch, triton, transformers; no
queue stack) and `pagedq.worker` (the queue stack on top). The common names are here, resolved on first use
(PEP 562), so `from pagedq import Client` loads no torch and `from pagedq import LLM` no Redis client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names below are, for type checkers and editors (at run time: __getattr__)
    from pagedq.engine.errors import RequestRejected as RequestRejected
    from pagedq.engine.llm import LLM as LLM
    from pagedq.engine.output.outputs import CompletionOutput as CompletionOutput
    from pagedq.engine.output.outputs import RequestOutput as RequestOutput
    from pagedq.engine.sample.sampling_params import SamplingParams as SamplingParams
    from pagedq.worker.client.async_client import AsyncClient as AsyncClient
    from pagedq.worker.client.sync_client import Client as Client
    from pagedq.worker.protocol.errors import JobFailed as JobFailed
    from pagedq.worker.protocol.errors import JobRejected as JobRejected
    from pagedq.worker.protocol.errors import PagedQError as PagedQError
    from pagedq.worker.protocol.errors import QueueFullError as QueueFullError
    from pagedq.worker.protocol.errors import ResultTimeout as ResultTimeout

# name -> the part that exports it (each part's own __init__ says from which module)
_EXPORTS = {
    **dict.fromkeys(("LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestRejected"), "pagedq.engine"),
    **dict.fromkeys(
        ("Client", "AsyncClient", "PagedQError", "JobFailed", "JobRejected", "QueueFullError", "ResultTimeout"),
        "pagedq.worker",
    ),
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> object:
    if name == "__version__":
        from importlib.metadata import version

        value: object = version("pagedq")
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'pagedq' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
