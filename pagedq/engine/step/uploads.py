"""Host data to the step's device without waiting for the device: the one way a step's inputs reach it.

`tensor.to("cuda")` from pageable host memory is a synchronous copy: torch drains the stream before returning, so
a step prepared while the previous one runs would wait for that step, and async scheduling would overlap nothing.
Here host data goes through pinned memory with non_blocking copies. torch's caching host allocator keeps each pinned
buffer until the copy reading it has run, so the host may rewrite its own arrays at once. On the CPU nothing is
copied: the tensor shares the array's memory, as torch.from_numpy does.
"""

from __future__ import annotations

import numpy as np
import torch


def staged(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """values as a host tensor a non_blocking copy to `device` may read: pinned when `device` is a GPU."""
    tensor = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
    if device.type != "cuda" or tensor.device.type != "cpu" or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def to_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """values on `device`, the copy queued behind the device's work instead of waiting for it."""
    return staged(values, device).to(device, non_blocking=True)


def copy_to_device(target: torch.Tensor, values: np.ndarray | torch.Tensor) -> None:
    """target.copy_(values), queued behind the device's work (a graph's static input buffers are filled so)."""
    target.copy_(staged(values, target.device), non_blocking=True)
