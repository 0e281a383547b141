"""Where a step draws: which logits are sampled, for which row and output position, and how many times.

Every step lays its draws out here, speculative or not. Most steps draw once per sampling chunk; a request about to
fork into n / best_of samples draws them all from its one row of logits; a speculative verify row draws at each of
its 1 + d positions (pagedq/engine/spec_decode/verify.py decides which of those draws it keeps). Fields are read
with map(attrgetter) into numpy (C loops): this runs every step for every sequence while the device waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

if TYPE_CHECKING:
    from pagedq.engine.core.step_plan import ScheduledChunk


class DrawRow(Protocol):
    """What the layout reads of a chunk's row (batch_state.RowInfo; a Protocol: batch_state imports this module)."""

    @property
    def fan_out(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass
class VerifyPlan:
    """A step's verify rows (R of them, d_r drafts each) in the layout of its draws."""

    rows: np.ndarray  # [R] batch-state rows
    first: np.ndarray  # [R] index of each verify row's first draw
    draws: np.ndarray  # [V] every draw of a verify row (V = sum of d_r + 1)
    draw_row: np.ndarray  # [V] its verify row (0..R-1)
    draw_step: np.ndarray  # [V] j: the draw after the row's j-th draft
    drafts: np.ndarray  # [D] the drafts, row by row (D = sum of d_r)
    draft_draws: np.ndarray  # [D] the draw each draft is compared with (the one drawn at its position)
    pad_index: np.ndarray  # [D] r * width + j: the draft's cell in an [R, width] matrix
    width: int  # the most drafts of a row

    def count_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(draw, token) pairs: each draft counted as an output by the penalties of every later draw of its row."""
        row, step = self.pad_index // self.width, self.pad_index % self.width
        per_row = np.bincount(row, minlength=len(self.rows))
        later = per_row[row] - step  # draws after draft j-1 (steps j .. d) in its row
        draws = np.repeat(self.first[row] + step + 1, later)
        draws += np.arange(len(draws)) - np.repeat(np.cumsum(later) - later, later)
        return draws, np.repeat(self.drafts, later)


class DrawLayout(NamedTuple):
    """A step's draws (N of them), in draw order: a row's draws are consecutive, rows in the chunks' order."""

    last_index: np.ndarray  # [N] flat token index whose logits the draw samples
    rows: np.ndarray  # [N] the draw's batch-state row
    draw_index: np.ndarray  # [N] fan-out draw number (0: the one the request itself keeps)
    positions: np.ndarray  # [N] the output position the draw is the token of
    verify: VerifyPlan | None  # the verify rows, None when no chunk brings drafts
    draw_chunk: np.ndarray  # [N] the chunk (index into the ordered chunks) the draw is of
    forking: np.ndarray  # chunks that fan out in this step: their rows' fan-out is spent once these draws are made


_NEEDS_SAMPLE, _FAN_OUT = attrgetter("needs_sample"), attrgetter("fan_out")
_START, _NUM_PROMPT, _DRAFTS = (
    attrgetter("start_position"),
    attrgetter("num_prompt_tokens"),
    attrgetter("draft_token_ids"),
)
_NONE = np.zeros(0, dtype=np.int64)


def draw_layout(
    ordered: list[ScheduledChunk], infos: Sequence[DrawRow], rows: np.ndarray, lengths: np.ndarray
) -> DrawLayout | None:
    """The draws of a step whose chunks are `ordered` (their row infos, batch-state rows and query lengths alike);
    None when nothing samples. Reads its arguments only: the caller spends the fan-out of `forking`."""
    count = len(ordered)
    chunks = np.flatnonzero(np.fromiter(map(_NEEDS_SAMPLE, ordered), dtype=bool, count=count))
    if not len(chunks):
        return None
    fan_out = np.fromiter(map(_FAN_OUT, infos), dtype=np.int64, count=count)[chunks]
    num_drafts = np.fromiter(map(len, map(_DRAFTS, ordered)), dtype=np.int64, count=count)[chunks]
    starts = np.fromiter(map(_START, ordered), dtype=np.int64, count=count)
    num_prompt = np.fromiter(map(_NUM_PROMPT, infos), dtype=np.int64, count=count)
    ends = np.cumsum(lengths)
    if not fan_out.any() and not num_drafts.any():  # one draw per sampling chunk: most steps
        positions = (starts + lengths - num_prompt)[chunks]
        draw_index = np.zeros(len(chunks), dtype=np.int64)
        return DrawLayout(ends[chunks] - 1, rows[chunks], draw_index, positions, None, chunks, _NONE)
    repeats = 1 + fan_out + num_drafts  # a row forks or verifies, never both (forks come with the first token)
    draw_chunk = np.repeat(chunks, repeats)
    offset = np.arange(len(draw_chunk)) - np.repeat(np.cumsum(repeats) - repeats, repeats)
    drafts_of_draw = np.repeat(num_drafts, repeats)
    verifying = drafts_of_draw > 0
    step = np.where(verifying, offset, 0)  # j: how many of the row's drafts precede this draw's position
    draw_index = np.where(verifying, 0, offset)
    back = drafts_of_draw - step  # positions before the row's last
    last_index = ends[draw_chunk] - 1 - back
    positions = (starts + lengths - num_prompt)[draw_chunk] - back
    verify = _verify_plan(ordered, chunks, num_drafts, rows, repeats, verifying, step) if verifying.any() else None
    return DrawLayout(last_index, rows[draw_chunk], draw_index, positions, verify, draw_chunk, chunks[fan_out > 0])


def _verify_plan(
    ordered: list[ScheduledChunk],
    chunks: np.ndarray,
    num_drafts: np.ndarray,
    rows: np.ndarray,
    repeats: np.ndarray,
    verifying: np.ndarray,
    step: np.ndarray,
) -> VerifyPlan:
    row_chunks = chunks[num_drafts > 0]
    counts = num_drafts[num_drafts > 0]
    first = (np.cumsum(repeats) - repeats)[num_drafts > 0]
    draws = np.flatnonzero(verifying)
    drafts = np.fromiter(
        (t for i in row_chunks.tolist() for t in ordered[i].draft_token_ids), dtype=np.int64, count=int(counts.sum())
    )
    draft_row = np.repeat(np.arange(len(counts)), counts)
    draft_step = np.arange(len(drafts)) - np.repeat(np.cumsum(counts) - counts, counts)
    width = int(counts.max())
    return VerifyPlan(
        rows=rows[row_chunks],
        first=first,
        draws=draws,
        draw_row=np.repeat(np.arange(len(counts)), counts + 1),
        draw_step=step[draws],
        drafts=drafts,
        draft_draws=first[draft_row] + draft_step,
        pad_index=draft_row * width + draft_step,
        width=width,
    )
