"""Decode steps replayed from CUDA graphs: one launch of a recorded forward pass instead of hundreds.

A decode step of a 16-layer model is ~200 kernel launches, each paying Python dispatch and launcher
checks on the host (several milliseconds at batch 256) while the GPU work itself takes about as long. So
decode-only steps run from graphs captured once per bucket (batch size, block-table width) and replayed.

A graph replays fixed addresses and fixed shapes, hence static buffers: each step's inputs are copied into
them, padded up to the bucket. Padding rows write no cache slot (slot -1) and attend to one token of block 0,
so they stay finite and touch nothing real; their outputs are dropped. The block-table width is bucketed
too, because the decode kernel sizes its partition grid and scratch from it: one width fixed at the model's
maximum length would make every short batch launch (and skip) the partitions of a 128k-token context.
Width buckets grow 4x from one decode partition (512 tokens), so a model of 4k tokens has 3 and one of
128k has 5; a batch runs in the first bucket that holds its longest table, its extra partitions exit at once.

`capture_all` records every bucket at start-up, largest batch first, as vLLM does (a warm-up run first, so
Triton has compiled every kernel before the capture; all rows are padding, so nothing is written). The
graphs share one memory pool: only one runs at a time, and its output is consumed before the next replay.
Without CUDA (`capture=False`) the same padded path runs eagerly: that is how the CPU tests check
everything here but the capture and replay calls themselves.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedq.engine.layers import AttentionMetadata
from pagedq.engine.step.uploads import copy_to_device

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # torch's own type for graph pools (private, but what its API is typed with)

# vLLM's capture sizes: small powers of two, then every 16 up to the largest batch.
SMALL_BATCH_SIZES = (1, 2, 4, 8)
BATCH_SIZE_STEP = 16
PARTITION_TOKENS = 512  # kernels.decode_attention.DEFAULT_PARTITION_SIZE
WIDTH_GROWTH = 4


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [b for b in SMALL_BATCH_SIZES if b < max_num_seqs]
    sizes += list(range(BATCH_SIZE_STEP, max_num_seqs, BATCH_SIZE_STEP))
    return sorted(set([*sizes, max_num_seqs]))


def bucket_for(value: int, buckets: list[int]) -> int:
    """The smallest bucket >= value (callers check value <= buckets[-1])."""
    return next(b for b in buckets if b >= value)


def width_buckets(max_blocks_per_seq: int, block_size: int, first_tokens: int = PARTITION_TOKENS) -> list[int]:
    widths, width = [], max(1, first_tokens // block_size)
    while width < max_blocks_per_seq:
        widths.append(width)
        width *= WIDTH_GROWTH
    return [*widths, max_blocks_per_seq]


class DecodeGraphRunner:
    def __init__(
        self,
        model,
        kv_caches,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        capture: bool,
        first_width_tokens: int = PARTITION_TOKENS,
    ) -> None:
        self.model, self.kv_caches, self.device, self.capture = model, kv_caches, device, capture
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.widths = width_buckets(max_blocks_per_seq, block_size, first_width_tokens)
        rows, width = self.batch_sizes[-1], self.widths[-1]

        def buffer(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = buffer(rows, dtype=torch.long)
        self.positions = buffer(rows, dtype=torch.long)
        self.slot_mapping = buffer(rows, dtype=torch.long)
        self.block_tables = buffer(rows, width, dtype=torch.int32)
        self.context_lens = buffer(rows, dtype=torch.int32)
        self._no_prefill = (
            buffer(0, width, dtype=torch.int32),
            buffer(1, dtype=torch.int32),
            buffer(0, dtype=torch.int32),
        )
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: _POOL_HANDLE | None = None  # the graphs' shared memory pool, from the first capture
        self.num_runs = 0  # decode steps served (replayed, or run padded when not capturing)

    def capture_all(self) -> float:
        """Record every (batch, width) bucket now; returns the seconds it took."""
        started = time.perf_counter()
        for width in reversed(self.widths):
            for batch in reversed(self.batch_sizes):
                self.fill_padding(batch)
                self.graphs[(batch, width)] = self._capture(batch, width)
        return time.perf_counter() - started

    def fill_padding(self, batch: int) -> None:
        """Inputs of `batch` padding rows: a forward pass over them writes no cache slot."""
        empty = np.zeros(0, dtype=np.int64)
        self._fill(empty, empty, empty, np.zeros((0, 0), dtype=np.int32), empty.astype(np.int32), batch, 0)

    def can_run(self, num_seqs: int, table_width: int) -> bool:
        return 0 < num_seqs <= self.batch_sizes[-1] and table_width <= self.widths[-1]

    def run(
        self,
        token_ids: np.ndarray | torch.Tensor,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        block_tables: np.ndarray,
        context_lens: np.ndarray,
    ) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of one decode token per sequence (host arrays in, device out)."""
        num_seqs, table_width = block_tables.shape
        batch = bucket_for(num_seqs, self.batch_sizes)
        width = bucket_for(table_width, self.widths)
        self._fill(token_ids, positions, slot_mapping, block_tables, context_lens, batch, width)
        self.num_runs += 1
        if not self.capture:
            return self._forward(batch, width)[:num_seqs]
        key = (batch, width)
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch, width)
        graph, output = self.graphs[key]
        graph.replay()
        return output[:num_seqs]

    def _fill(self, token_ids, positions, slot_mapping, block_tables, context_lens, batch: int, width: int) -> None:
        n, w = block_tables.shape

        def put(buffer: torch.Tensor, values: np.ndarray | torch.Tensor, pad: int) -> None:
            # token ids may already be on the device (async scheduling fills in the previous step's draws there)
            copy_to_device(buffer[:n], values)
            buffer[n:batch].fill_(pad)

        put(self.input_ids, token_ids, 0)
        put(self.positions, positions, 0)
        put(self.slot_mapping, slot_mapping, -1)  # padding rows store nothing
        put(self.context_lens, context_lens, 1)  # ... and attend to one slot of block 0
        # Entries past a row's context are never read, so stale ones from earlier steps may stay; padding rows
        # read entry 0, which must name a real block: block 0.
        copy_to_device(self.block_tables[:n, :w], block_tables)
        self.block_tables[n:batch, 0] = 0

    def _forward(self, batch: int, width: int) -> torch.Tensor:
        no_tables, no_cu_seqlens, no_lens = self._no_prefill
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            num_decode_tokens=batch,
            decode_block_tables=self.block_tables[:batch, :width],
            decode_context_lens=self.context_lens[:batch],
            prefill_block_tables=no_tables[:, :width],
            prefill_cu_seqlens_q=no_cu_seqlens,
            prefill_context_lens=no_lens,
        )
        return self.model(self.input_ids[:batch], self.positions[:batch], self.kv_caches, meta)

    def _capture(self, batch: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The warm-up compiles the Triton kernels for these shapes and lets cuBLAS pick its algorithms: neither
        # may happen inside a capture. Its cache writes, if any, are the ones the next replay repeats.
        self._forward(batch, width)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self._forward(batch, width)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, output
