"""Who fills the steps' masks, and when: at once, or on one background thread while the engine goes on.

With async scheduling a step is launched before the tokens of the step in flight are known, so its mask waits
(`pending`) until they are; it then fills on the filler thread (xgrammar's threads, the GIL released) while the
engine thread schedules and prepares the next step. Which matcher fills which row is decided on the engine thread
(StepMask.collect); the matchers must not move while a fill reads them, hence `settle()`: every caller that moves a
matcher waits for the fills in progress first. The masks' host buffers are recycled, never reallocated a step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagedq.engine.structured_output.interfaces import BatchMatcher
from pagedq.engine.structured_output.matcher import SequenceGrammar
from pagedq.engine.structured_output.step_mask import StepMask

# A mask's buffer is taken again this many masks later: by then its step has finished (at most two are in flight).
_BUFFERS_IN_USE = 2


class MaskFiller:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.pending: list[StepMask] = []  # masks of launched steps that wait for the tokens before theirs
        self.filling: list[Future] = []  # fills submitted and maybe not done: no matcher moves until they are
        self._buffers: list[torch.Tensor] = []  # the last masks' tensors, oldest first
        self._thread: ThreadPoolExecutor | None = None  # one fill at a time, in step order
        self._batch: BatchMatcher | None = None

    def new_mask(
        self, draw_rows: list[int], req_ids: list[str], num_draws: int, drafts: dict[str, tuple[int, ...]]
    ) -> StepMask:
        buffer = self._buffers.pop(0) if len(self._buffers) > _BUFFERS_IN_USE else None
        mask = StepMask(draw_rows, req_ids, num_draws, self.vocab_size, buffer, drafts)
        self._buffers.append(mask.buffer)
        return mask

    def fill_now(self, mask: StepMask, matchers: Mapping[str, SequenceGrammar]) -> None:
        """On the engine thread: every token before the mask's draws is known."""
        self.settle()
        mask.fill(matchers, self._batch_matcher())

    def defer(self, mask: StepMask) -> None:
        """Filled by fill_pending() once the step before it is processed."""
        self.pending.append(mask)

    def fill_pending(self, matchers: Mapping[str, SequenceGrammar]) -> None:
        """The pending masks, on the filler thread, from `matchers` (a sequence not there keeps its row
        all-allowed: its draw is dropped)."""
        masks, self.pending = self.pending, []
        if not masks:
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedq-mask")
        batch = self._batch_matcher()
        for mask in masks:
            self.filling.append(self._thread.submit(mask.collect(matchers), batch))

    def settle(self) -> None:
        """Wait for the fills in progress (a failed one has already failed its step's device work)."""
        filling, self.filling = self.filling, []
        for future in filling:
            future.exception()

    def cancel_pending(self) -> None:
        """An earlier step failed: the pending masks' steps stop at their sampling (and are recomputed)."""
        masks, self.pending = self.pending, []
        for mask in masks:
            mask.cancel()

    def _batch_matcher(self) -> BatchMatcher:
        if self._batch is None:
            from pagedq.engine.structured_output.backend import xgrammar

            # a core left to the engine thread, which schedules the next step while the mask fills
            self._batch = xgrammar().BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) - 1)))
        return self._batch

    def close(self) -> None:
        self.cancel_pending()
        self.settle()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
