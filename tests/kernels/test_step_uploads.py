"""A step's host data reaches the device without waiting for the device (pagedq/engine/step/uploads.py).

Here under the interpreter the device is the CPU, where an upload is the host array itself; on a GPU (.ci/gpu-check
runs this folder compiled) torch's sync debug mode turns any copy that would drain the stream into an error, while
a slow kernel is still running ahead of it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedq.engine.step.uploads import copy_to_device, to_device


@pytest.fixture
def no_stream_sync(device):
    if device != "cuda":
        yield
        return
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(20):  # keep the stream busy: a synchronising copy would now have to wait
        busy = busy @ busy / 64
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float32])
def test_an_upload_equals_the_host_array_and_the_host_may_rewrite_it_at_once(device, no_stream_sync, dtype):
    array = np.arange(1, 1001, dtype=dtype).reshape(10, 100)
    expected = array.copy()
    uploaded = to_device(array, torch.device(device))
    target = torch.zeros(10, 100, dtype=uploaded.dtype, device=device)
    copy_to_device(target, array)
    if device != "cuda":  # on the CPU an upload is the array itself: no copy at all
        assert uploaded.data_ptr() == array.ctypes.data
        assert torch.equal(target, torch.from_numpy(expected))
        return
    array[:] = -1  # the pinned staging copy was taken: rewriting the host array cannot reach the device
    torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(uploaded.cpu(), torch.from_numpy(expected))
    assert torch.equal(target.cpu(), torch.from_numpy(expected))


def test_a_tensor_already_on_the_device_is_not_copied(device):
    tensor = torch.arange(8, device=device)
    assert to_device(tensor, torch.device(device)).data_ptr() == tensor.data_ptr()
