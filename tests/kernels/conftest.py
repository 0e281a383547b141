"""Kernel tests: every Triton kernel against `kernels.reference`.

Without a GPU the kernels run through Triton's interpreter, which Triton reads when the kernels are *defined*,
so TRITON_INTERPRET is set here, at import time, before any test module imports `kernels.triton_ops`.
On a GPU box, `TRITON_INTERPRET=0 python -m pytest tests/kernels` runs the same tests compiled on CUDA.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from pagedq.kernels import triton_ops
from pagedq.kernels.kv_cache import _store_kv_cache_kernel
from pagedq.kernels.triton_common import runs_in_interpreter


def _kernel_device() -> str:
    if runs_in_interpreter(_store_kv_cache_kernel):
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    raise pytest.UsageError(
        "pagedq.kernels.triton_ops was imported with TRITON_INTERPRET unset/0 and there is no GPU: "
        "run tests/kernels with TRITON_INTERPRET=1 (or first in the session)"
    )


@pytest.fixture(scope="session")
def device() -> str:
    """Where test tensors live: CPU under the interpreter, CUDA when the kernels are compiled."""
    return _kernel_device()


@pytest.fixture(scope="session")
def ops():
    return triton_ops


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
