"""The engine's adapters on the host: registered names, a least-recently-used cache of loaded weights, slots.

- `add(lora)` loads and checks an adapter now (a `LoRALoadError` names the problem) and registers its name.
- A request names an adapter by `LoRARequest`: a registered name is used as it is (its path must match); an unknown
  one is loaded first, so a bad adapter is refused at `add_request`, before it reaches the scheduler.
- The host cache keeps up to `max_cpu_loras` adapters; the least recently used one that no unfinished request
  uses is dropped past that (adapters of unfinished requests are never dropped: their slots may need them), and a
  registered name whose weights were dropped is read from its folder again when a request names it.
- `remove(name)` unregisters the name at once (no new request may use that adapter; a later `add` of the name is a
  new adapter, with its own identity); the weights and the slot go once no unfinished request uses it.

Every loaded adapter has its own key (a counter): slots and the prefix cache are keyed by it, so an adapter
re-added under the same name never meets the blocks or the slot of the one before it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable

from pagedq.engine.lora.adapter import LoRAAdapter, LoRALoadError, ModelTargets, load_adapter
from pagedq.engine.lora.request import LoRARequest
from pagedq.engine.lora.slots import SlotTable


class LoRAManager:
    def __init__(self, targets: ModelTargets, max_loras: int, max_cpu_loras: int, max_rank: int) -> None:
        self.targets, self.max_cpu_loras, self.max_rank = targets, max_cpu_loras, max_rank
        self.slots = SlotTable(max_loras)
        self._keys = itertools.count(1)  # 0 is the base model
        self._registered: dict[str, LoRAAdapter] = {}  # name -> the adapter it names now (weights maybe dropped)
        self._cache: OrderedDict[int, LoRAAdapter] = OrderedDict()  # key -> loaded adapter, least recent first
        self._removed: dict[int, LoRAAdapter] = {}  # unregistered, waiting for their last users to finish
        self.num_disk_loads = 0

    # ---- registration ----------------------------------------------------------------------------------
    def add(self, lora: LoRARequest, in_use: Callable[[], set[int]]) -> LoRAAdapter:
        """Load, check and register an adapter now (a name already registered from the same path: itself)."""
        known = self._registered.get(lora.name)
        if known is not None:
            if known.path != lora.path:
                raise LoRALoadError(
                    f"LoRA adapter {lora.name!r} is already loaded from {known.path}, not {lora.path}: "
                    "remove it first, or use another name"
                )
            self._ensure_loaded(known.key, in_use)
            return self._cache[known.key]
        adapter = self._read(next(self._keys), lora.name, lora.path)
        self._registered[lora.name] = adapter
        self._insert(adapter, in_use)
        return adapter

    def remove(self, name: str) -> None:
        adapter = self._registered.pop(name, None)
        if adapter is None:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")
        self._removed[adapter.key] = adapter

    def registered(self) -> list[LoRARequest]:
        return [LoRARequest(a.name, a.path) for a in self._registered.values()]

    def key_for(self, lora: LoRARequest, in_use: Callable[[], set[int]]) -> int:
        """The key of the adapter a new request names (loading it first if needed; LoRALoadError if it cannot)."""
        return self.add(lora, in_use).key

    # ---- the host cache --------------------------------------------------------------------------------
    def weights(self, key: int) -> LoRAAdapter:
        """A loaded adapter by key (adapters of unfinished requests are always loaded)."""
        adapter = self._cache[key]
        self._cache.move_to_end(key)
        return adapter

    def _ensure_loaded(self, key: int, in_use: Callable[[], set[int]]) -> None:
        if key in self._cache:
            self._cache.move_to_end(key)
            return
        known = next(a for a in self._registered.values() if a.key == key)
        self._insert(self._read(key, known.name, known.path), in_use)

    def _read(self, key: int, name: str, path: str) -> LoRAAdapter:
        self.num_disk_loads += 1
        return load_adapter(key, name, path, self.targets, self.max_rank)

    def _insert(self, adapter: LoRAAdapter, in_use: Callable[[], set[int]]) -> None:
        self._cache[adapter.key] = adapter
        if len(self._cache) > self.max_cpu_loras:
            busy = in_use() | {adapter.key}
            for key in [k for k in self._cache if k not in busy][: len(self._cache) - self.max_cpu_loras]:
                del self._cache[key]
                if key in self._removed:
                    self._finish_removal(key)

    def release_removed(self, in_use: set[int]) -> None:
        """Drop removed adapters no unfinished request uses any more (weights and slot)."""
        for key in [k for k in self._removed if k not in in_use]:
            self._cache.pop(key, None)
            self._finish_removal(key)

    def _finish_removal(self, key: int) -> None:
        del self._removed[key]
        self.slots.forget(key)

    @property
    def has_removals(self) -> bool:
        return bool(self._removed)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def stats(self) -> dict[str, int]:
        """Adapters loaded on the host, reads from disk, loads into device slots (the engine's stats())."""
        return {
            "num_loras_loaded": len(self._cache),
            "num_lora_disk_loads": self.num_disk_loads,
            "num_lora_slot_loads": self.slots.num_loads,
        }
