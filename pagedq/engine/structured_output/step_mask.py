"""One step's token bitmask over the draws of its structured sequences.

The host fills it (xgrammar's matchers, one row per structured draw; the other rows stay all-allowed and are not
touched); the sampler applies it to exactly those rows' logits, before logit bias, penalties, temperature and
filters. With async scheduling the step's forward is already running when the host learns the previous step's
tokens: `apply` (device work) then waits for `ready`, so only the sampling of a step with structured draws waits,
never its forward, and a step without any never waits at all (vLLM #26866). Such a mask is filled on a
background thread (xgrammar's threads, the GIL released) while the engine thread schedules and prepares the next
step; the matchers are touched again only once that fill is done (MaskFiller.settle).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from pagedq.engine.structured_output.backend import xgrammar
from pagedq.engine.structured_output.interfaces import BatchMatcher
from pagedq.engine.structured_output.matcher import SequenceGrammar

# A filled mask arrives within one host step; this only guards the device thread against a host that died.
_READY_TIMEOUT_S = 300.0


class StepCancelled(RuntimeError):
    """The step's mask will never be filled (an earlier step failed): its device work stops here."""


class StepMask:
    def __init__(
        self,
        draw_rows: list[int],
        req_ids: list[str],
        num_draws: int,
        vocab_size: int,
        buffer: torch.Tensor | None = None,
        drafts: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.draw_rows = draw_rows  # which draws of the step are structured
        self.req_ids = req_ids  # the sequence whose matcher fills each of them
        # speculative verify rows: request id -> its drafts; its 1 + d draws get the masks after drafts[:j]
        self.drafts = drafts or {}
        # xgrammar's allocate_token_bitmask layout. With a recycled `buffer` (MaskFiller) only the
        # structured rows are written (fill, collect): the others are never applied (apply's indices). Without one
        # every row starts all-allowed. Never torch.full: it spreads the 4 MB of a 256 x 128k mask over its
        # intra-op threads, and a fresh 4 MB page-faults every step (docs/benchmarks-log.md#why-the-mask-was-slow).
        words = -(-vocab_size // 32)
        if buffer is None or buffer.shape[0] < num_draws or buffer.shape[1] != words:
            buffer = torch.from_numpy(np.full((num_draws, words), -1, dtype=np.int32))
            if torch.cuda.is_available():  # pinned once, for the non-blocking copy to the device
                buffer = buffer.pin_memory()
        self.buffer: torch.Tensor = buffer
        self.bitmask = buffer[:num_draws]
        self.vocab_size = vocab_size
        self._ready = threading.Event()
        self._cancelled = False
        self.error: str | None = None  # why the fill failed (the step's device work raises it)
        self.fill_seconds, self.num_filled = 0.0, 0  # the fill's time and matchers (bench host --sampling json)

    @property
    def is_filled(self) -> bool:
        return self._ready.is_set()

    def fill(self, matchers: Mapping[str, SequenceGrammar], batch: BatchMatcher) -> None:
        """One row per structured draw from its sequence's matcher, filled by xgrammar's BatchGrammarMatcher on
        its own threads (`batch`); a sequence that left keeps all-allowed (its draw is dropped)."""
        self.collect(matchers)(batch)

    def collect(self, matchers: Mapping[str, SequenceGrammar]) -> Callable[[BatchMatcher], None]:
        """On the engine thread: which matcher fills which row. The returned job fills them (any thread: xgrammar
        releases the GIL) and marks the mask ready, or failed with the error the device work then raises."""
        rows, live, copies = [], [], []
        first_row: dict[str, int] = {}
        verify: dict[str, tuple[SequenceGrammar, list[int]]] = {}  # request id -> (its matcher, its draws' rows)
        for row, req_id in zip(self.draw_rows, self.req_ids):
            state = matchers.get(req_id)
            if state is None:  # left, or stops now: all allowed (its draw is dropped)
                self.bitmask[row] = -1
                continue
            if req_id in self.drafts:  # a verify row's draws, in position order (engine/step/draws.draw_layout)
                verify.setdefault(req_id, (state, []))[1].append(row)
                continue
            if req_id in first_row:  # a fan-out's further draws (n, best_of): the same row, copied below
                copies.append((row, first_row[req_id]))  # (one matcher is never filled by two threads at once)
                continue
            first_row[req_id] = row
            rows.append(row)
            live.append(state.matcher)

        def job(batch: BatchMatcher) -> None:
            start = time.perf_counter()
            try:
                if len(live) == 1:
                    live[0].fill_next_token_bitmask(self.bitmask, rows[0])
                elif live:
                    batch.batch_fill_next_token_bitmask(live, self.bitmask, indices=rows)
                for req_id, (state, verify_rows) in verify.items():  # one at a time: each advances and rolls back
                    state.fill_verify_rows(self.bitmask, verify_rows, self.drafts[req_id])
                for row, source in copies:
                    self.bitmask[row] = self.bitmask[source]
            except BaseException as error:
                self.error = f"the structured-output mask could not be filled: {error}"
                raise
            finally:
                self.fill_seconds, self.num_filled = time.perf_counter() - start, len(live) + len(verify)
                self._ready.set()

        return job

    def cancel(self) -> None:
        self._cancelled = True
        self._ready.set()

    def apply(self, logits: torch.Tensor) -> None:
        """Device work: wait for the host's rows, then mask the structured rows of `logits` in place."""
        if not self._ready.wait(_READY_TIMEOUT_S):
            raise StepCancelled("the structured-output mask of this step was never filled")
        if self._cancelled:
            raise StepCancelled("an earlier step failed; this one is recomputed")
        if self.error is not None:
            raise StepCancelled(self.error)
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=self.draw_rows)
