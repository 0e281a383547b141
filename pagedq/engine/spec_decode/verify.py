"""The runner's side of speculative decoding: where a step draws, and which draws verification keeps.

A verify row brings its last token and d drafts x_1..x_d (d + 1 query tokens over its paged context: the prefill
kernel's path). The sampler then draws at each of its d + 1 positions exactly as an ordinary step would draw the
token of that output position: same seed (the Gumbel noise is keyed by seed, output position and token), min_tokens
ban by position, logit_bias, filters, and penalties that count the drafts before the position. Draft x_j is accepted
iff the draw y_{j-1} equals it; the row emits the longest accepted prefix and the draw after it (the bonus token when
every draft passes). For a deterministic draft (n-gram: probability 1) this is the rejection sampler of Leviathan et
al.: P(accept x) = p(x), and on rejection y is a draw from p restricted to tokens other than x, i.e. p with x's mass
removed, renormalised. So the output distribution is the target's, token for token, and a seeded request draws the
very tokens it draws without speculation (docs/engine.md).

The acceptance runs on the device (a cumulative product of equalities); rejected draws come back as -1 and the host
drops them. The row's latest token and, with penalties, its output-token counts take exactly the emitted tokens.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedq.engine.step.verify_plan import VerifyPlan

if TYPE_CHECKING:
    from pagedq.engine.core.step_plan import ScheduledChunk
    from pagedq.engine.step.batch_state import BatchState, RowInfo


_NEEDS_SAMPLE, _FAN_OUT = attrgetter("needs_sample"), attrgetter("fan_out")
_START, _NUM_PROMPT, _DRAFTS = (
    attrgetter("start_position"),
    attrgetter("num_prompt_tokens"),
    attrgetter("draft_token_ids"),
)


def draw_layout(ordered: list[ScheduledChunk], infos: list[RowInfo], rows: np.ndarray, lengths: np.ndarray):
    """(flat token index whose logits are sampled, batch-state row, fan-out draw number, output position, the
    verify plan or None, the chunk each draw is of) per draw, as arrays; None when nothing samples. A request about
    to fork into several samples draws them all from its one row of logits (and forks only once: its fan-out is
    spent here); a verify row draws at each of its 1 + d positions. Fields are read with map(attrgetter) (C loops:
    this runs every step for every sequence while the device waits)."""
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
        return ends[chunks] - 1, rows[chunks], np.zeros(len(chunks), dtype=np.int64), positions, None, chunks
    repeats = 1 + fan_out + num_drafts  # a row forks or verifies, never both (forks come with the first token)
    draw_chunk = np.repeat(chunks, repeats)
    offset = np.arange(len(draw_chunk)) - np.repeat(np.cumsum(repeats) - repeats, repeats)
    drafts_of_draw = np.repeat(num_drafts, repeats)
    verifying = drafts_of_draw > 0
    step = np.where(verifying, offset, 0)  # j: how many of the row's drafts precede this draw's position
    draw_index = np.where(verifying, 0, offset)
    for i in chunks[fan_out > 0].tolist():
        infos[i].fan_out = 0
    back = drafts_of_draw - step  # positions before the row's last
    last_index = ends[draw_chunk] - 1 - back
    positions = (starts + lengths - num_prompt)[draw_chunk] - back
    verify = _verify_plan(ordered, chunks, num_drafts, rows, repeats, verifying, step) if verifying.any() else None
    return last_index, rows[draw_chunk], draw_index, positions, verify, draw_chunk


def _verify_plan(ordered, chunks, num_drafts, rows, repeats, verifying, step) -> VerifyPlan:
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


def accept(token_ids: torch.Tensor, plan: VerifyPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device work: (token ids with every draw past a row's first rejected draft set to -1, accepted drafts per
    verify row, whether each verify draw is emitted)."""
    device = token_ids.device

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    match = torch.zeros(len(plan.rows) * plan.width, dtype=torch.long, device=device)
    match[to_device(plan.pad_index)] = (token_ids[to_device(plan.draft_draws)] == to_device(plan.drafts)).long()
    accepted = match.view(len(plan.rows), plan.width).cumprod(dim=1).sum(dim=1)
    draws = to_device(plan.draws)
    emitted = to_device(plan.draw_step) <= accepted[to_device(plan.draw_row)]
    masked = token_ids.clone()
    masked[draws] = torch.where(emitted, token_ids[draws], -1)
    return masked, accepted, emitted


def record_verified(state: BatchState, plan: VerifyPlan, token_ids: torch.Tensor) -> torch.Tensor:
    """Device work after sampling: accept, then each verify row's latest token is its last emitted one and, for rows
    with penalties, every emitted token is one more output count. Returns the token ids with rejected draws -1."""
    device = token_ids.device
    masked, accepted, emitted = accept(token_ids, plan)
    rows = torch.from_numpy(plan.rows).to(device)
    state.last_token[rows] = token_ids[torch.from_numpy(plan.first).to(device) + accepted]
    penalised = state.uses_penalties[plan.rows[plan.draw_row]]
    if penalised.any():
        draws = torch.from_numpy(plan.draws[penalised]).to(device)
        draw_rows = torch.from_numpy(plan.rows[plan.draw_row[penalised]]).to(device)
        counts = state.penalty_counts()
        counts.index_put_((draw_rows, token_ids[draws]), emitted[torch.from_numpy(penalised).to(device)].float(), True)
    return masked
