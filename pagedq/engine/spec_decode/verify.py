"""The runner's side of speculative decoding: which draws verification keeps (where a step draws, verify rows
included: pagedq/engine/step/draws.py).

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

from typing import TYPE_CHECKING

import torch

from pagedq.engine.step.uploads import to_device

if TYPE_CHECKING:
    from pagedq.engine.step.batch_state import BatchState
    from pagedq.engine.step.draws import VerifyPlan


def accept(token_ids: torch.Tensor, plan: VerifyPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device work: (token ids with every draw past a row's first rejected draft set to -1, accepted drafts per
    verify row, whether each verify draw is emitted)."""
    device = token_ids.device

    match = torch.zeros(len(plan.rows) * plan.width, dtype=torch.long, device=device)
    match[to_device(plan.pad_index, device)] = (
        token_ids[to_device(plan.draft_draws, device)] == to_device(plan.drafts, device)
    ).long()
    accepted = match.view(len(plan.rows), plan.width).cumprod(dim=1).sum(dim=1)
    draws = to_device(plan.draws, device)
    emitted = to_device(plan.draw_step, device) <= accepted[to_device(plan.draw_row, device)]
    masked = token_ids.clone()
    masked[draws] = torch.where(emitted, token_ids[draws], -1)
    return masked, accepted, emitted


def record_verified(state: BatchState, plan: VerifyPlan, token_ids: torch.Tensor) -> torch.Tensor:
    """Device work after sampling: accept, then each verify row's latest token is its last emitted one and, for rows
    with penalties, every emitted token is one more output count. Returns the token ids with rejected draws -1."""
    device = token_ids.device
    masked, accepted, emitted = accept(token_ids, plan)
    rows = to_device(plan.rows, device)
    state.last_token[rows] = token_ids[to_device(plan.first, device) + accepted]
    penalised = state.uses_penalties[plan.rows[plan.draw_row]]
    if penalised.any():
        draws = to_device(plan.draws[penalised], device)
        draw_rows = to_device(plan.rows[plan.draw_row[penalised]], device)
        counts = state.penalty_counts()
        counts.index_put_((draw_rows, token_ids[draws]), emitted[to_device(penalised, device)].float(), True)
    return masked
