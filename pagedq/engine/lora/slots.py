"""Which adapter holds which device slot: host bookkeeping for the scheduler (no tensors here).

A slot is *in use* while a running request uses its adapter; the scheduler keeps the adapters of running requests
within `max_loras`, so every step's adapters hold slots. An adapter admitted without a slot takes a free one, else
the least recently used idle one (kept loaded until then: an adapter coming back finds its weights in place). The
load it needs is queued here and handed to the model runner with the step's plan; the runner performs it in order
with the device work, after every step launched before it, so a slot is never rewritten under a step using it.
"""

from __future__ import annotations

from collections import OrderedDict


class SlotTable:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter key -> slot, least recently assigned first
        self._free = list(range(max_loras - 1, -1, -1))
        self._loads: list[tuple[int, int]] = []  # (slot, adapter key) to load before the next step's forward
        self.num_loads = 0

    def fits(self, key: int, running_keys: set[int]) -> bool:
        """Whether a request of adapter `key` may run next to requests of `running_keys`."""
        return key in running_keys or len(running_keys) < self.max_loras

    def assign(self, key: int, running_keys: set[int]) -> int:
        """The slot of adapter `key` for a request being admitted (callers checked `fits`)."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._slot_of.move_to_end(key)
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            victim = next(k for k in self._slot_of if k not in running_keys)
            slot = self._slot_of.pop(victim)
        self._slot_of[key] = slot
        self._loads.append((slot, key))
        self.num_loads += 1
        return slot

    def forget(self, key: int) -> None:
        """An unloaded adapter (no request uses it any more): its slot is free."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def take_loads(self) -> list[tuple[int, int]]:
        loads, self._loads = self._loads, []
        return loads

    def resident(self) -> dict[int, int]:
        return dict(self._slot_of)
