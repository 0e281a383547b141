"""The CPU path of the batched LoRA add (kernels.lora's `lora_add`), grouped by adapter slot.

With few tokens per slot (decode, short chunks) one call of the native kernel (kernels.cpu_native.lora_add), which
reads each slot's weights once per 8 of its tokens. Otherwise torch ops over the step's `SlotRows` layout: batched
matmuls, whose register-blocked GEMM does more per weight byte when a slot has many tokens (prefill).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch

from pagedq.kernels import cpu_native
from pagedq.kernels.lora import LoRAIndex, SlotRows, check_lora_add_shapes

# A call moving up to this many elements is decode-sized: it runs on one thread (_small_work_on_one_thread) and
# gathers its result back (SlotRows); a larger one runs on all threads and adds its result in place.
SMALL_CALL_ELEMENTS = 1 << 18
# A call whose slots have at most this many tokens each runs natively where it can (runs_native).
NATIVE_MAX_SLOT_TOKENS = 16


def grouped_lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    index: LoRAIndex,
    out_sizes: tuple[int, ...],
) -> None:
    """CPU path of `lora_add`: with few tokens per slot (decode) one call of the native kernel where it builds
    (kernels.cpu_native.lora_add), otherwise `torch_ops_lora_add`."""
    check_lora_add_shapes("lora_add", y, x, lora_a, lora_b, index, out_sizes)
    if not index.has_adapter:
        return
    if runs_native(y, x, lora_a, lora_b, index):
        cpu_native.lora_add(y, x, lora_a, lora_b, index.token_order, index.slot_starts, index.slot_lengths, out_sizes)
    else:
        torch_ops_lora_add(y, x, lora_a, lora_b, index, out_sizes)


def torch_ops_lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    index: LoRAIndex,
    out_sizes: tuple[int, ...],
) -> None:
    """`lora_add` by torch ops laid out by `SlotRows`: one batched matmul over every slot, or one per slot, for the
    shrink and for each slice's expand; the shrunk rows stay in the layout between the two. The caller checked the
    shapes (grouped_lora_add)."""
    _, num_slices, rank, in_dim = lora_a.shape
    layout = index.slot_rows
    offsets = [0, *itertools.accumulate(out_sizes)]
    num_elements = layout.num_rows * (in_dim + y.shape[1])
    gather_back = num_elements <= SMALL_CALL_ELEMENTS  # decode-sized (see SlotRows)
    with _small_work_on_one_thread(num_elements, y.device):
        rows = x.index_select(0, layout.token_of_row).float()
        delta = torch.empty((layout.num_rows + gather_back, y.shape[1]), dtype=torch.float32, device=y.device)
        if layout.grid is not None:
            groups, length = layout.grid
            a = _slots_of(lora_a, layout).reshape(groups, num_slices * rank, in_dim).float()
            b = _slots_of(lora_b, layout)  # [G, N, max_out, R]
            shrunk = torch.bmm(rows.view(groups, length, in_dim), a.transpose(1, 2))  # [G, L, N * R]
            delta_by_group = delta[: layout.num_rows].view(groups, length, -1)
            for n, size in enumerate(out_sizes):
                _product_into(delta_by_group, offsets[n], shrunk[:, :, n * rank : (n + 1) * rank], b[:, n, :size])
        else:
            for slot, first, length in layout.segments:
                shrunk = rows[first : first + length] @ lora_a[slot].reshape(num_slices * rank, in_dim).float().T
                for n, size in enumerate(out_sizes):
                    part = shrunk[:, n * rank : (n + 1) * rank]
                    _product_into(delta[first : first + length], offsets[n], part, lora_b[slot, n, :size])
        if gather_back:
            delta[-1].zero_()  # the row base-model tokens read
            _add_at(y, None, delta.index_select(0, layout.row_of_token))
        else:
            real = delta if layout.real_rows is None else delta.index_select(0, layout.real_rows)
            _add_at(y, layout.real_tokens, real)


def runs_native(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, index: LoRAIndex) -> bool:
    """Whether a call goes to the native kernel (kernels.cpu_native.lora_add): few tokens per slot, and tensors it
    takes. It reads a slot's weights once per 8 of the slot's tokens, so with many tokens per slot (prefill) the
    batched matmuls below, which block for cache, do better at higher ranks (docs/kernels.md)."""
    if index.max_segment_length > NATIVE_MAX_SLOT_TOKENS:
        return False
    return cpu_native.lora_supports(y, x, lora_a, lora_b) and cpu_native.available()


def _product_into(out: torch.Tensor, offset: int, shrunk: torch.Tensor, weights: torch.Tensor) -> None:
    """out[..., offset : offset + out_n] = shrunk [.., R] @ weights [out_n, R].T (batched or not), in fp32.

    Straight into `out` when the columns are all of it: torch's matmuls write a strided `out=` through a slow
    per-matrix loop, so a slice of a packed output is computed apart and copied in."""
    size = weights.shape[-2]
    product = torch.bmm if shrunk.dim() == 3 else torch.mm
    if offset == 0 and size == out.shape[-1]:
        product(shrunk, weights.float().transpose(-1, -2), out=out)
    else:
        out[..., offset : offset + size].copy_(product(shrunk, weights.float().transpose(-1, -2)))


def _add_at(y: torch.Tensor, tokens: torch.Tensor | None, delta: torch.Tensor) -> None:
    """y[tokens] += delta (every row of y when tokens is None), added in fp32 and rounded once to y's dtype."""
    if tokens is None:
        if y.dtype == torch.float32:
            y.add_(delta)
        else:
            y.copy_(y.float().add_(delta))
    elif y.dtype == torch.float32:
        y.index_add_(0, tokens, delta)
    else:
        y.index_copy_(0, tokens, y.index_select(0, tokens).float().add_(delta).to(y.dtype))


def _slots_of(weights: torch.Tensor, layout: SlotRows) -> torch.Tensor:
    """The stacked weights of the batched layout's slots: a slice of the stack when they are consecutive (no copy)."""
    if layout.slot_span is not None:
        return weights[layout.slot_span[0] : layout.slot_span[1]]
    return weights.index_select(0, layout.grid_slots)


@contextlib.contextmanager
def _small_work_on_one_thread(num_elements: int, device: torch.device) -> Iterator[None]:
    """Run a decode-sized call's ops on the calling thread: each op that torch parallelises wakes the other
    intra-op threads, and under passive waiting (`OMP_WAIT_POLICY=PASSIVE`, which a CPU worker sharing its cores
    needs) that wake-up costs more than these small ops gain from a second thread. Measured in
    docs/benchmarks-log.md (LoRA adapters)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or num_elements > SMALL_CALL_ELEMENTS:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
