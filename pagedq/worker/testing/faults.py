"""Test-only fault injection around any engine (stub or real), switched on by environment variables.

PAGEDQ_FAULT_PROMPT=<text>: every engine.step() raises while a request whose prompt contains <text> is in
the engine (a "poison" job that breaks the whole batch, as a kernel error on one sequence would).
PAGEDQ_FAULT_MODE=exit: instead of raising, the process dies at once (os._exit), like a segfault.
PAGEDQ_FAULT_MODE=break: the first such request breaks the engine for good: every later step raises, whatever
it holds (a CUDA error that poisons the context, a lost GPU).
"""

from __future__ import annotations

import os
from typing import Any

ENV_PROMPT = "PAGEDQ_FAULT_PROMPT"
ENV_MODE = "PAGEDQ_FAULT_MODE"


class FaultyEngine:
    def __init__(self, engine: Any, poison: str, mode: str = "raise") -> None:
        if mode not in ("raise", "exit", "break"):
            raise ValueError(f"fault mode must be raise, exit or break, got {mode!r}")
        self._engine, self._poison, self._mode = engine, poison, mode
        self._live: set[str] = set()
        self.broken = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def add_request(self, request_id: str, prompt: Any, params: Any, priority: int = 0, lora: Any = None) -> None:
        if lora is None:  # an engine without adapters need not take the keyword
            self._engine.add_request(request_id, prompt, params, priority=priority)
        else:
            self._engine.add_request(request_id, prompt, params, priority=priority, lora=lora)
        if isinstance(prompt, str) and self._poison in prompt:
            self._live.add(request_id)

    def abort_request(self, request_id: str) -> Any:
        self._live.discard(request_id)
        return self._engine.abort_request(request_id)

    # the admission queries of the WorkerEngine protocol: the wrapped engine's answers
    def num_prompt_tokens(self, prompt: str | list[int]) -> int:
        return self._engine.num_prompt_tokens(prompt)

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
        return self._engine.blocks_needed(num_prompt_tokens, max_tokens, n)

    @property
    def waiting_blocks_needed(self) -> int:
        return self._engine.waiting_blocks_needed

    def step(self) -> list:
        if self._live or self.broken:
            if self._mode == "exit":
                os._exit(86)
            self.broken = self._mode == "break"
            raise RuntimeError(
                f"injected fault: a request with {self._poison!r} in its prompt is in the batch"
                if not self.broken
                else "injected fault: the engine is broken"
            )
        outputs = self._engine.step()
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        return outputs


def requested_by() -> dict[str, str]:
    """The variables that switched it on, for the log line."""
    return {name: os.environ[name] for name in (ENV_PROMPT, ENV_MODE) if name in os.environ}


def wrap_from_env(engine: Any) -> Any:
    poison = os.environ.get(ENV_PROMPT)
    if not poison:
        return engine
    return FaultyEngine(engine, poison, os.environ.get(ENV_MODE, "raise"))
