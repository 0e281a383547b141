"""Admission under the LoRA adapter limit: the adapters of running requests stay within `max_loras` (the device
slots, pagedq/engine/lora/slots.py), so every step's adapters hold slots.

A waiting request whose adapter finds no slot is passed over by the requests behind it that fit (their adapter runs
already, or they use the base model) for at most LORA_PASS_LIMIT schedules. After that admission stops behind it:
the running requests drain, and the first adapter whose last running request finishes frees its slot for it. So a
request held back by the limit is admitted within LORA_PASS_LIMIT schedules plus the longest remaining run of the
requests running then (tested as a property in tests/engine/test_lora_scheduler.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedq.engine.core.request import Request

if TYPE_CHECKING:
    from pagedq.engine.lora.adapter import LoRAAdapter
    from pagedq.engine.lora.manager import LoRAManager

# Schedules a request held back by the adapter limit lets others pass it: long enough that requests for adapters
# already running keep the batch full while it waits, short enough to bound its wait.
LORA_PASS_LIMIT = 32


class AdapterAdmission:
    """One step's admissions under the adapter limit (the scheduler builds one per step that admits)."""

    def __init__(self, lora: LoRAManager, running: Iterable[Request], num_schedules: int) -> None:
        self.slots, self.num_schedules = lora.slots, num_schedules
        self.running_keys = {r.lora_key for r in running if r.lora_key}

    def fits(self, request: Request) -> bool:
        return not request.lora_key or self.slots.fits(request.lora_key, self.running_keys)

    def may_be_passed(self, request: Request) -> bool:
        """Whether requests behind `request`, which does not fit, may still be admitted before it."""
        if request.lora_blocked_since < 0:
            request.lora_blocked_since = self.num_schedules
        return self.num_schedules - request.lora_blocked_since < LORA_PASS_LIMIT

    def admitted(self, request: Request) -> None:
        """Give an admitted request its adapter's slot (loaded with the step's plan if the adapter holds none)."""
        request.lora_blocked_since = -1
        if request.lora_key:
            request.lora_slot = self.slots.assign(request.lora_key, self.running_keys)
            self.running_keys.add(request.lora_key)


def take_slot_loads(lora: LoRAManager | None) -> tuple[tuple[int, LoRAAdapter], ...]:
    """The (slot, adapter) loads the step's admissions queued, for its plan."""
    if lora is None:
        return ()
    return tuple((slot, lora.weights(key)) for slot, key in lora.slots.take_loads())
