"""Batched LoRA: the per-step token-to-slot index, the torch reference, and the CPU path grouped by slot.

A step's tokens may each use a different adapter. Adapters live in `S` device slots, stacked and zero-padded to
the maximum rank `R`; a packed linear (qkv_proj: N = 3, gate_up_proj: N = 2, others: N = 1) has one A and one B
per slice. Two kernels apply them around the base matmul `y = x @ W.T`:

    lora_shrink(x [T, in], lora_a [S, N, R, in], index) -> buf [N, T, R] fp32
        buf[n, t] = x[t] @ lora_a[slot_t, n].T for adapter tokens, 0 for base-model tokens (slot -1)
    lora_expand(y [T, sum(out_sizes)], buf [N, T, R], lora_b [S, N, max_out, R], index, out_sizes) -> None
        y[t, off_n : off_n + out_n] += buf[n, t] @ lora_b[slot_t, n, :out_n].T for adapter tokens, in place

Both accumulate in fp32; expand adds in fp32 and rounds once to y's dtype. The scaling (lora_alpha / r, or
/ sqrt(r) for rsLoRA) is the caller's to fold into lora_b.

`LoRAIndex` is built once per step from the tokens' slots and used by every layer: the tokens sorted by slot
(stable), so each slot's tokens form one contiguous segment of `token_order`, and each slot's segment start and
length. A slot's segment is addressed by the slot number itself, so every tensor has a fixed shape for a fixed
(T, S): a CUDA graph captures kernels reading a static index (`LoRAIndex.static`) whose tensors are refilled in
place before each replay (`copy_from`); its launch grid covers T rows per slot instead of the step's longest
segment, and empty segments return at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MAX_SLICES = 3  # qkv_proj; the Triton launchers pass the slice sizes as scalars


@dataclass(frozen=True)
class LoRAIndex:
    """Which adapter slot each token of a step uses, laid out for the batched LoRA kernels.

    token_slots [T] int32: the slot of each token, -1 for the base model.
    token_order [T] int32: token positions sorted by slot, stably (base-model tokens first).
    slot_starts [S] int32, slot_lengths [S] int32: slot s's tokens are token_order[start : start + length].
    has_adapter: whether any token uses an adapter (a host bool: a step without adapters skips LoRA entirely).
    max_segment_length: the most tokens of one slot (host int); the Triton grid's row extent.
    host_segments: (slot, start, length) of each slot present, on the host, for the CPU path.
    """

    token_slots: torch.Tensor
    token_order: torch.Tensor
    slot_starts: torch.Tensor
    slot_lengths: torch.Tensor
    has_adapter: bool
    max_segment_length: int
    host_segments: tuple[tuple[int, int, int], ...]

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @functools.cached_property
    def padded_segments(self) -> PaddedSegments:
        """The CPU path's batched layout of the segments, computed at the first layer's call of the step."""
        return PaddedSegments.of(self.host_segments, self.token_order)

    @property
    def num_slots(self) -> int:
        return self.slot_starts.shape[0]

    @classmethod
    def build(cls, token_slots: torch.Tensor, num_slots: int, device: torch.device | str | None = None) -> LoRAIndex:
        """The index of a step whose token t uses slot token_slots[t] (-1: base model), 0 <= slot < num_slots.

        Computed on the host (the scheduler's slots are host data; the host fields need them there anyway) and
        moved to `device` (default: token_slots' device) in one copy.
        """
        if token_slots.dim() != 1:
            raise ValueError(f"LoRAIndex.build: token_slots must be [T], got shape {tuple(token_slots.shape)}")
        if num_slots < 1:
            raise ValueError(f"LoRAIndex.build: num_slots must be >= 1, got {num_slots}")
        target = torch.device(device) if device is not None else token_slots.device
        slots = token_slots.to("cpu", torch.int64)
        if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= num_slots):
            raise ValueError(
                f"LoRAIndex.build: slots must lie in [-1, {num_slots}), got [{int(slots.min())}, {int(slots.max())}]"
            )
        order = torch.sort(slots, stable=True).indices
        lengths = torch.bincount(slots[slots >= 0], minlength=num_slots)
        num_base = int((slots < 0).sum())
        starts = num_base + torch.cumsum(lengths, 0) - lengths
        host_lengths = lengths.tolist()
        host_starts = starts.tolist()
        segments = tuple((s, host_starts[s], n) for s, n in enumerate(host_lengths) if n)
        packed = torch.cat([slots, order, starts, lengths]).to(torch.int32).to(target)
        t = slots.shape[0]
        return cls(
            token_slots=packed[:t],
            token_order=packed[t : 2 * t],
            slot_starts=packed[2 * t : 2 * t + num_slots],
            slot_lengths=packed[2 * t + num_slots :],
            has_adapter=bool(segments),
            max_segment_length=max(host_lengths, default=0),
            host_segments=segments,
        )

    @classmethod
    def static(cls, num_tokens: int, num_slots: int, device: torch.device | str) -> LoRAIndex:
        """Fixed buffers for a CUDA graph of `num_tokens` tokens: every token on the base model until `copy_from`
        fills them. Its grid spans num_tokens rows per slot, so any later index of the same (T, S) fits."""
        return cls(
            token_slots=torch.full((num_tokens,), -1, dtype=torch.int32, device=device),
            token_order=torch.arange(num_tokens, dtype=torch.int32, device=device),
            slot_starts=torch.full((num_slots,), num_tokens, dtype=torch.int32, device=device),
            slot_lengths=torch.zeros(num_slots, dtype=torch.int32, device=device),
            has_adapter=True,
            max_segment_length=num_tokens,
            host_segments=(),
        )

    def copy_from(self, other: LoRAIndex) -> None:
        """Refill this (static) index's tensors in place from `other`, an index of the same (T, S)."""
        if (other.num_tokens, other.num_slots) != (self.num_tokens, self.num_slots):
            raise ValueError(
                f"LoRAIndex.copy_from: shape (T={other.num_tokens}, S={other.num_slots}) != "
                f"(T={self.num_tokens}, S={self.num_slots})"
            )
        if other.max_segment_length > self.max_segment_length:
            raise ValueError("LoRAIndex.copy_from: the target's grid is too small; build it with LoRAIndex.static")
        for name in ("token_slots", "token_order", "slot_starts", "slot_lengths"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)


@dataclass(frozen=True)
class PaddedSegments:
    """The segments of the slots present as a [G, L] grid of token rows (G slots, L the longest segment), so the
    CPU path runs one batched matmul over every slot instead of a matmul per slot.

    slots [G]: the slots present, ascending. rows [G, L]: each segment's tokens, padded with its first token.
    real [V]: the positions in the flattened grid holding a real (not padding) row, in segment order.
    tokens [V]: the tokens at those positions (token_order's adapter part). waste: padding rows / real rows.
    """

    slots: torch.Tensor
    rows: torch.Tensor
    real: torch.Tensor
    tokens: torch.Tensor
    waste: float

    @classmethod
    def of(cls, segments: tuple[tuple[int, int, int], ...], token_order: torch.Tensor) -> PaddedSegments:
        longest = max((length for _, _, length in segments), default=0)
        order = token_order.long()
        within = torch.arange(longest, device=order.device)
        starts = torch.tensor([start for _, start, _ in segments], dtype=torch.long, device=order.device)
        lengths = torch.tensor([length for _, _, length in segments], dtype=torch.long, device=order.device)
        is_real = within[None, :] < lengths[:, None]
        rows = order[starts[:, None] + torch.where(is_real, within[None, :], 0)]
        num_real = int(lengths.sum())
        return cls(
            slots=torch.tensor([slot for slot, _, _ in segments], dtype=torch.long, device=order.device),
            rows=rows,
            real=is_real.flatten().nonzero().flatten(),
            tokens=rows[is_real],
            waste=(len(segments) * longest - num_real) / max(num_real, 1),
        )


# Past this much padding (padding rows per real row) the CPU path loops over the slots instead of padding them.
MAX_PADDING_WASTE = 0.5


def check_lora_shapes(
    fn: str, activations: torch.Tensor, weights: torch.Tensor, index: LoRAIndex, in_dim: int, weights_layout: str
) -> None:
    """The checks every implementation shares: T matches the index, S matches the slots, the inner dim matches."""
    if activations.shape[0] != index.num_tokens:
        raise ValueError(f"{fn}: {activations.shape[0]} token rows but the index has T = {index.num_tokens}")
    if weights.dim() != 4 or weights.shape[0] != index.num_slots or weights.shape[-1] != in_dim:
        raise ValueError(
            f"{fn}: weights must be {weights_layout} with S = {index.num_slots} and last dim {in_dim}, "
            f"got {tuple(weights.shape)}"
        )
    if weights.shape[1] > MAX_SLICES:
        raise ValueError(f"{fn}: at most {MAX_SLICES} slices per packed linear, got {weights.shape[1]}")


def check_lora_expand_shapes(
    fn: str, y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, index: LoRAIndex, out_sizes: tuple[int, ...]
) -> None:
    check_lora_shapes(fn, y, lora_b, index, buf.shape[-1], "[S, N, max_out, R]")
    num_slices = lora_b.shape[1]
    if buf.dim() != 3 or buf.shape[0] != num_slices or buf.shape[1] != index.num_tokens:
        raise ValueError(f"{fn}: buf must be [N={num_slices}, T={index.num_tokens}, R], got {tuple(buf.shape)}")
    if len(out_sizes) != num_slices or any(n < 0 or n > lora_b.shape[2] for n in out_sizes):
        raise ValueError(f"{fn}: out_sizes {out_sizes} must give {num_slices} sizes, each <= {lora_b.shape[2]}")
    if y.dim() != 2 or y.shape[1] != sum(out_sizes):
        raise ValueError(f"{fn}: y must be [T, {sum(out_sizes)}] (the sum of out_sizes), got {tuple(y.shape)}")


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, index: LoRAIndex) -> torch.Tensor:
    """Reference: x [T, in], lora_a [S, N, R, in] -> buf [N, T, R] fp32, a gather of each token's A (the oracle)."""
    check_lora_shapes("lora_shrink", x, lora_a, index, x.shape[-1], "[S, N, R, in]")
    slots = index.token_slots.long()
    active = slots >= 0
    weights = lora_a[slots.clamp(min=0)].float()  # [T, N, R, in]
    buf = torch.einsum("ti,tnri->ntr", x.float(), weights)
    return (buf * active[None, :, None]).contiguous()


def lora_expand(
    y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, index: LoRAIndex, out_sizes: tuple[int, ...]
) -> None:
    """Reference: y [T, sum(out_sizes)] += per slice buf[n, t] @ lora_b[slot_t, n, :out_n].T, adapter tokens only."""
    check_lora_expand_shapes("lora_expand", y, buf, lora_b, index, out_sizes)
    slots = index.token_slots.long()
    active = slots >= 0
    weights = lora_b[slots.clamp(min=0)].float()  # [T, N, max_out, R]
    delta = torch.einsum("ntr,tnor->tno", buf.float(), weights)
    offset = 0
    for n, size in enumerate(out_sizes):
        rows = y[:, offset : offset + size]
        updated = (rows.float() + delta[:, n, :size]).to(y.dtype)
        rows.copy_(torch.where(active[:, None], updated, rows))
        offset += size


def grouped_lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, index: LoRAIndex) -> torch.Tensor:
    """CPU path of `lora_shrink`: one batched matmul over the slots' segments padded to the longest (decode), or
    one matmul per slot where padding would cost more than the loop (segments of unequal lengths)."""
    check_lora_shapes("lora_shrink", x, lora_a, index, x.shape[-1], "[S, N, R, in]")
    num_slots, num_slices, rank, in_dim = lora_a.shape
    buf = torch.zeros((num_slices, x.shape[0], rank), dtype=torch.float32, device=x.device)
    if not index.has_adapter:
        return buf
    if len(index.host_segments) > 1 and index.padded_segments.waste <= MAX_PADDING_WASTE:
        grid = index.padded_segments
        weights = lora_a if len(grid.slots) == num_slots else lora_a[grid.slots]  # every slot present: no copy
        rows = x[grid.rows].float()  # [G, L, in]
        product = torch.bmm(rows, weights.reshape(len(grid.slots), num_slices * rank, in_dim).float().transpose(1, 2))
        buf[:, grid.tokens] = product.reshape(-1, num_slices, rank)[grid.real].transpose(0, 1)
        return buf
    order = index.token_order.long()
    for slot, start, length in index.host_segments:
        rows = order[start : start + length]
        weights = lora_a[slot].reshape(num_slices * rank, -1)
        product = x[rows].float() @ weights.float().T  # [rows, N * R]
        buf[:, rows] = product.view(length, num_slices, rank).transpose(0, 1)
    return buf


def grouped_lora_expand(
    y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, index: LoRAIndex, out_sizes: tuple[int, ...]
) -> None:
    """CPU path of `lora_expand`: batched over the padded segments as `grouped_lora_shrink`, else per slot."""
    check_lora_expand_shapes("lora_expand", y, buf, lora_b, index, out_sizes)
    if not index.has_adapter:
        return
    if len(index.host_segments) > 1 and index.padded_segments.waste <= MAX_PADDING_WASTE:
        grid = index.padded_segments
        weights = lora_b if len(grid.slots) == lora_b.shape[0] else lora_b[grid.slots]  # [G, N, max_out, R]
        shrunk = buf[:, grid.rows]  # [N, G, L, R]
        deltas = [
            torch.bmm(shrunk[n], weights[:, n, :size].float().transpose(1, 2)) for n, size in enumerate(out_sizes)
        ]  # [G, L, out_n] each
        delta = (deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)).reshape(-1, y.shape[1])[grid.real]
        _add_rows(y, grid.tokens, delta)
        return
    order = index.token_order.long()
    for slot, start, length in index.host_segments:
        rows = order[start : start + length]
        delta = torch.cat([buf[n, rows] @ lora_b[slot, n, :size].float().T for n, size in enumerate(out_sizes)], -1)
        _add_rows(y, rows, delta)


def _add_rows(y: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor) -> None:
    """y[rows] += delta (fp32), added in fp32 and rounded once to y's dtype."""
    if y.dtype == torch.float32:
        y.index_add_(0, rows, delta)
    else:
        y[rows] = (y[rows].float() + delta).to(y.dtype)
