"""One step's flattened batch on the host, decode tokens first (numpy: built without per-token Python)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from engine.batch_state import RowInfo
from engine.step_data import ScheduledChunk


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

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode == len(self.lengths)


def build_step_inputs(
    ordered: list[ScheduledChunk], infos: list[RowInfo], rows: np.ndarray, block_tables: np.ndarray, block_size: int
) -> StepInputs:
    # numpy, not Python lists or torch.tensor(nested lists): this runs every step on the host while the GPU
    # waits, and at 256 sequences with ~100-block tables the list version cost several milliseconds.
    lengths = np.fromiter((c.num_new_tokens for c in ordered), dtype=np.int64, count=len(ordered))
    starts = np.fromiter((c.start_position for c in ordered), dtype=np.int64, count=len(ordered))
    # Only a decode can bring a token still unknown (the one its previous step is drawing): decodes come first,
    # so its flat index is its chunk's index.
    unknown = [i for i, (c, info) in enumerate(zip(ordered, infos)) if c.start_position >= len(info.token_ids)]
    # A verify row brings its drafts after its known tokens (engine/spec/verify.py).
    token_ids = np.fromiter(
        itertools.chain.from_iterable(
            (info.token_ids[c.start_position : c.start_position + c.num_new_tokens] or (0,))
            if not c.draft_token_ids
            else (*info.token_ids[c.start_position :], *c.draft_token_ids)
            for c, info in zip(ordered, infos)
        ),
        dtype=np.int64,
        count=int(lengths.sum()),
    )
    placeholders = np.array(unknown, dtype=np.int64)
    placeholder_rows = rows[placeholders]
    rows = np.repeat(np.arange(len(ordered)), lengths)
    chunk_offsets = np.arange(len(token_ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = starts[rows] + chunk_offsets
    pages = block_tables[rows, positions // block_size].astype(np.int64)
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
