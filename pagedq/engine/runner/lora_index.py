"""A step's LoRA index on the device, built on the host and uploaded without waiting for the device."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pagedq.engine.step.uploads import to_device
from pagedq.kernels.lora import LoRAIndex


def step_lora_index(token_slots: np.ndarray, num_slots: int, device: torch.device) -> LoRAIndex:
    """The LoRAIndex of a step whose token t uses slot token_slots[t] (-1: the base model), on `device`.

    Built on the host (its host fields need the slots there) and moved through pinned memory (step/uploads.py): a
    pageable copy would drain the stream, and the step prepared while another runs would wait for it."""
    host = LoRAIndex.build(torch.from_numpy(token_slots), num_slots, "cpu")
    if device.type == "cpu":
        return host
    return dataclasses.replace(
        host,
        token_slots=to_device(host.token_slots, device),
        token_order=to_device(host.token_order, device),
        slot_starts=to_device(host.slot_starts, device),
        slot_lengths=to_device(host.slot_lengths, device),
    )
