"""Batched LoRA: the per-step token-to-slot index, its layout for the CPU path (`SlotRows`), and the torch
reference.

A step's tokens may each use a different adapter. Adapters live in `S` device slots, stacked and zero-padded to
the maximum rank `R`; a packed linear (qkv_proj: N = 3, gate_up_proj: N = 2, others: N = 1) has one A and one B
per slice. Two kernels apply them around the base matmul `y = x @ W.T`:

    lora_shrink(x [T, in], lora_a [S, N, R, in], index) -> buf [N, T, R] fp32
        buf[n, t] = x[t] @ lora_a[slot_t, n].T for adapter tokens, 0 for base-model tokens (slot -1)
    lora_expand(y [T, sum(out_sizes)], buf [N, T, R], lora_b [S, N, max_out, R], index, out_sizes) -> None
        y[t, off_n : off_n + out_n] += buf[n, t] @ lora_b[slot_t, n, :out_n].T for adapter tokens, in place

Both accumulate in fp32; expand adds in fp32 and rounds once to y's dtype. The scaling (lora_alpha / r, or
/ sqrt(r) for rsLoRA) is the caller's to fold into lora_b. The adapted layer calls their composition,

    lora_add(y, x, lora_a, lora_b, index, out_sizes) -> None:  lora_expand(y, lora_shrink(x, lora_a), lora_b)

which the CPU path (kernels.cpu_lora) computes in one pass and the Triton backend as the two kernels.

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
    def slot_rows(self) -> SlotRows:
        """The CPU path's layout of the step's adapter tokens, computed at the first layer's call of the step."""
        return SlotRows.of(self)

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
class SlotRows:
    """The CPU path's layout of a step's adapter tokens: a matrix of rows grouped by slot, and the maps both ways.

    Each layer gathers its adapter tokens' activations into these rows once (`index_select`) and computes every
    slot's part into its own rows. A decode-sized result goes back by a gather per token, reading `row_of_token`
    with one extra zero row for base-model tokens, and one dense add: on the CPU, advanced indexing, `index_add_`
    and accumulating `index_put_` cost far more than the gather at these sizes, more than the LoRA matmuls. A
    prefill-sized one is added in place at its tokens (`index_add_` of `real_rows` into `real_tokens`), which
    moves the result once where the gather and the add move it twice.

    Batched (`grid` set, G slots by L rows): each present slot's segment padded with its first token to the
    longest, so one batched matmul covers every slot (decode, where segments have similar lengths). Otherwise
    the slots' segments back to back, one matmul per slot (prefill, where padding would cost more than the loop).

    token_of_row [rows]: the token each row holds. row_of_token [T]: each token's row, `rows` for base tokens.
    real_rows [V]: the rows that are not padding (None: all are); real_tokens [V]: their tokens.
    segments: (slot, first row, length) of each slot present, ascending. grid: (G, L) when batched, else None.
    grid_slots [G]: the slots present; slot_span: (first, last + 1) when they are consecutive (slots are handed
    out from 0, so they mostly are), so a slice of the stacked weights serves them without a copy.
    waste: padding rows / real rows of the batched layout.
    """

    token_of_row: torch.Tensor
    row_of_token: torch.Tensor
    real_rows: torch.Tensor | None
    real_tokens: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]
    grid: tuple[int, int] | None
    grid_slots: torch.Tensor
    slot_span: tuple[int, int] | None
    waste: float

    @property
    def num_rows(self) -> int:
        return self.token_of_row.shape[0]

    @classmethod
    def of(cls, index: LoRAIndex) -> SlotRows:
        segments = index.host_segments
        order = index.token_order.long()
        num_tokens = order.shape[0]
        num_base = num_tokens - sum(length for _, _, length in segments)
        longest = max((length for _, _, length in segments), default=0)
        num_real = num_tokens - num_base
        waste = (len(segments) * longest - num_real) / max(num_real, 1)
        slots = torch.tensor([slot for slot, _, _ in segments], dtype=torch.long, device=order.device)
        if len(segments) > 1 and waste <= MAX_PADDING_WASTE:
            within = torch.arange(longest, device=order.device)
            starts = torch.tensor([start for _, start, _ in segments], dtype=torch.long, device=order.device)
            lengths = torch.tensor([length for _, _, length in segments], dtype=torch.long, device=order.device)
            is_real = within[None, :] < lengths[:, None]  # [G, L]
            token_of_row = order[starts[:, None] + torch.where(is_real, within[None, :], 0)].flatten()
            row_of_token = torch.full((num_tokens,), token_of_row.shape[0], dtype=torch.long, device=order.device)
            real = is_real.flatten().nonzero().flatten()
            row_of_token[token_of_row[real]] = real
            real_rows: torch.Tensor | None = real
            grid: tuple[int, int] | None = (len(segments), longest)
        else:
            token_of_row = order[num_base:]
            row_of_token = torch.full((num_tokens,), num_real, dtype=torch.long, device=order.device)
            row_of_token[token_of_row] = torch.arange(num_real, device=order.device)
            real_rows, grid = None, None
        return cls(
            token_of_row=token_of_row,
            row_of_token=row_of_token,
            real_rows=real_rows if real_rows is None or real_rows.shape[0] < token_of_row.shape[0] else None,
            real_tokens=token_of_row if real_rows is None else token_of_row[real_rows],
            segments=tuple((slot, start - num_base, length) for slot, start, length in segments),
            grid=grid,
            grid_slots=slots,
            slot_span=(segments[0][0], segments[-1][0] + 1) if _consecutive(segments) else None,
            waste=waste,
        )


def _consecutive(segments: tuple[tuple[int, int, int], ...]) -> bool:
    return bool(segments) and segments[-1][0] - segments[0][0] == len(segments) - 1


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
    _check_out_sizes(fn, y, lora_b, out_sizes)


def _check_out_sizes(fn: str, y: torch.Tensor, lora_b: torch.Tensor, out_sizes: tuple[int, ...]) -> None:
    """One size per slice of lora_b, each within its rows, and y exactly as wide as their sum."""
    if len(out_sizes) != lora_b.shape[1] or any(n < 0 or n > lora_b.shape[2] for n in out_sizes):
        raise ValueError(f"{fn}: out_sizes {out_sizes} must give {lora_b.shape[1]} sizes, each <= {lora_b.shape[2]}")
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


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    index: LoRAIndex,
    out_sizes: tuple[int, ...],
) -> None:
    """Reference: y += each adapter token's LoRA product, `lora_expand(y, lora_shrink(x, lora_a), lora_b)`."""
    lora_expand(y, lora_shrink(x, lora_a, index), lora_b, index, out_sizes)


def check_lora_add_shapes(
    fn: str, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, index: LoRAIndex,
    out_sizes: tuple[int, ...],
) -> None:  # fmt: skip
    check_lora_shapes(fn, x, lora_a, index, x.shape[-1], "[S, N, R, in]")
    if lora_b.shape[:2] != lora_a.shape[:2]:
        raise ValueError(f"{fn}: lora_b {tuple(lora_b.shape)} must have lora_a's [S, N] {tuple(lora_a.shape[:2])}")
    check_lora_shapes(fn, y, lora_b, index, lora_a.shape[2], "[S, N, max_out, R]")
    _check_out_sizes(fn, y, lora_b, out_sizes)
