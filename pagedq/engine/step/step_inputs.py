"""One step's flattened batch on the host, decode tokens first (numpy: built without per-token Python)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter, getitem

import numpy as np

from pagedq.engine.core.step_plan import ScheduledChunk
from pagedq.engine.step.batch_state import RowInfo


@dataclass
class StepInputs:
    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: cache slot each token's K/V goes to
    block_tables: np.ndarray  # [S, M] int32
    context_lens: np.ndarray  # [S] int32: tokens each sequence attends to, this step's included
    lengths: np.ndarray  # [S] int64: tokens each sequence brings this step
    num_decode: int  # sequences with a single token (the first num_decode rows)
    # Flat indices of tokens the host does not know yet (drawn by the step still in flight) and the batch-state
    # rows whose latest draw they are; their entries in token_ids are 0 until the device fills them in.
    placeholders: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    placeholder_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # [T] int64: the RoPE table row each token reads, where that is not its position (LongRoPE's short rows,
    # pagedq/engine/layers/rotary.py); None: its position
    rope_rows: np.ndarray | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode == len(self.lengths)


_NUM_NEW = attrgetter("num_new_tokens")
_START = attrgetter("start_position")
_TOKEN_IDS = attrgetter("token_ids")
_DRAFTS = attrgetter("draft_token_ids")


def decodes_first(
    chunks: Sequence[ScheduledChunk], rows: list[int], infos: list[RowInfo]
) -> tuple[list[ScheduledChunk], np.ndarray, list[RowInfo], np.ndarray]:
    """The step's chunks with the decodes first, in order otherwise (a stable sort), with their rows, infos and
    token counts. Per-field arrays come from map(attrgetter): C loops, no generator frame per sequence."""
    lengths = np.fromiter(map(_NUM_NEW, chunks), dtype=np.int64, count=len(chunks))
    multi = lengths > 1
    if (multi[:-1] <= multi[1:]).all():  # already decodes first: most steps
        return list(chunks), np.array(rows, dtype=np.int64), infos, lengths
    order = np.argsort(multi, kind="stable")
    picked = order.tolist()
    row_array = np.array(rows, dtype=np.int64)[order]
    return [chunks[i] for i in picked], row_array, [infos[i] for i in picked], lengths[order]


def build_step_inputs(
    ordered: list[ScheduledChunk],
    infos: list[RowInfo],
    rows: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    lengths: np.ndarray | None = None,
) -> StepInputs:
    # numpy, not Python lists or torch.tensor(nested lists): this runs every step on the host while the GPU
    # waits, and at 256 sequences with ~100-block tables the list version cost several milliseconds.
    count = len(ordered)
    if lengths is None:
        lengths = np.fromiter(map(_NUM_NEW, ordered), dtype=np.int64, count=count)
    starts = np.fromiter(map(_START, ordered), dtype=np.int64, count=count)
    token_lists = list(map(_TOKEN_IDS, infos))
    num_known = np.fromiter(map(len, token_lists), dtype=np.int64, count=count)
    # Only a decode can bring a token still unknown (the one its previous step is drawing): decodes come first,
    # so its flat index is its chunk's index.
    unknown = np.flatnonzero(starts >= num_known)
    total = int(lengths.sum())
    if (lengths == 1).all() and not any(map(_DRAFTS, ordered)):  # decodes only: a token each, no drafts
        token_ids = np.zeros(count, dtype=np.int64)
        known = np.flatnonzero(starts < num_known)
        if len(known) == count:
            token_ids[:] = list(map(getitem, token_lists, starts.tolist()))
        elif len(known):
            token_ids[known] = [token_lists[i][start] for i, start in zip(known.tolist(), starts[known].tolist())]
    else:
        # A verify row brings its drafts after its known tokens (pagedq/engine/spec_decode/verify.py).
        token_ids = np.fromiter(
            itertools.chain.from_iterable(
                (info.token_ids[c.start_position : c.start_position + c.num_new_tokens] or (0,))
                if not c.draft_token_ids
                else (*info.token_ids[c.start_position :], *c.draft_token_ids)
                for c, info in zip(ordered, infos)
            ),
            dtype=np.int64,
            count=total,
        )
    placeholders = unknown.astype(np.int64)
    placeholder_rows = rows[placeholders]
    flat_rows = np.repeat(np.arange(count), lengths)
    chunk_offsets = np.arange(len(token_ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = starts[flat_rows] + chunk_offsets
    pages = block_tables[flat_rows, positions // block_size].astype(np.int64)
    return StepInputs(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=pages * block_size + positions % block_size,
        block_tables=block_tables,
        context_lens=(starts + lengths).astype(np.int32),
        lengths=lengths,
        num_decode=int(np.count_nonzero(lengths == 1)),
        placeholders=placeholders,
        placeholder_rows=placeholder_rows,
    )
