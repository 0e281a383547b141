"""Attention over gathered, padded K/V on the CPU, shared by the decode and prefill plans of
pagedq/kernels/cpu_attention.py and pagedq/kernels/cpu_prefill.py: how rows of different context lengths are cut
into groups that are each padded to their own longest (length_groups), and the call over one group's K/V (attend:
torch's SDPA, or the manual softmax a soft-cap or sinks need)."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from pagedq.kernels import reference

# A group's fixed cost (an index_select pair and an SDPA call, ~40 us) in the units of its work, sequences x padded
# tokens (~0.2 us each at head dim 64 on the 2-core CPU): a split must save more padded work than this to pay.
GROUP_COST_TOKENS = 256
MAX_LENGTH_GROUPS = 4


def length_groups(context_lens: np.ndarray, block_size: int) -> list[tuple[int, int, int]]:
    """(start, end, longest context) of each group of the sequences sorted by context length: the cut that saves the
    most padded work, applied again to each side while it saves more than a group costs (at most 4 groups)."""
    padded = -(-np.sort(context_lens) // block_size) * block_size  # what a group gathers per sequence, at most
    groups = [(0, len(padded))]
    while len(groups) < MAX_LENGTH_GROUPS:
        best = max(((*_best_cut(padded, start, end), i) for i, (start, end) in enumerate(groups)), default=None)
        if best is None or best[0] <= GROUP_COST_TOKENS:
            break
        _, cut, i = best
        start, end = groups[i]
        groups[i : i + 1] = [(start, cut), (cut, end)]
    return [(start, end, int(padded[end - 1])) for start, end in groups]


def _best_cut(padded: np.ndarray, start: int, end: int) -> tuple[int, int]:
    """(padded work saved, cut) of the best split of sorted padded[start:end] into two groups; (0, start) if none."""
    if end - start < 2:
        return 0, start
    cuts = np.arange(start + 1, end)
    split_cost = (cuts - start) * padded[cuts - 1] + (end - cuts) * padded[end - 1]
    best = int(np.argmin(split_cost))
    return int((end - start) * padded[end - 1] - split_cost[best]), int(cuts[best])


# The manual path (soft-cap or sinks, which SDPA cannot take) scores this many query rows x keys at once, at most.
MANUAL_SCORES_PER_SLICE = 1 << 22


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, H, R, D] over k, v [B, H, L, D] with a bool mask broadcastable to [B, H, R, L] (True =
    attend; None: all): by SDPA, or, with a soft-cap or sinks (broadcastable to [B, H, R, 1]), by scores and
    reference.attention_probs in fp32, R sliced so no slice's scores pass MANUAL_SCORES_PER_SLICE per head."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    keys, values = k.float(), v.float()
    visible = torch.ones(1, 1, 1, 1, dtype=torch.bool) if mask is None else mask
    rows = max(1, MANUAL_SCORES_PER_SLICE // max(1, k.shape[2] * q.shape[0]))
    for start in range(0, q.shape[2], rows):
        part = slice(start, start + rows)
        scores = torch.matmul(q[:, :, part].float(), keys.transpose(-1, -2)) * scale
        row_mask = visible[:, :, part] if visible.shape[2] > 1 else visible
        row_sinks = None if sinks is None else (sinks[:, :, part] if sinks.shape[2] > 1 else sinks)
        probs = reference.attention_probs(scores, row_mask, softcap, row_sinks)
        out[:, :, part] = torch.matmul(probs, values).to(q.dtype)
    return out
