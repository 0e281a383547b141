"""copy_blocks: copy whole KV-cache blocks within every layer's K and V cache (copy-on-write of shared blocks).

(The module is not named copy_blocks.py: importing a submodule kernels.copy_blocks would rebind the
attribute kernels.copy_blocks, the dispatcher the engine calls, to the module.)

Shapes and strides
    key_caches, value_caches  L tensors each, [num_blocks, block_size, Hkv, D], contiguous, one shape and dtype
    block_mapping             [N, 2] int64 (or int32) rows (src, dst)

Math: for every cache c of the 2L and every row (src, dst): c[dst] = c[src]. A block is block_size*Hkv*D
adjacent elements, so block b of cache c starts at element b * BLOCK_NUMEL of c.

One launch covers every layer and every pair. The 2L caches are separate allocations, so the kernel gets the
first key cache as its typed base pointer plus a small int64 table of each cache's distance from that base,
in units of 16 bytes when every cache is 16-byte aligned (always true for torch allocations). The kernel
multiplies the table entry by the constexpr number of elements per 16 bytes, so the compiler can still prove
16-byte alignment and emit vector loads, which a raw pointer loaded from memory would not allow. Under
Triton's interpreter CPU tensors are used in place, so the same pointer arithmetic runs there unchanged.
Grid: (pairs, 2L caches, chunks of CHUNK elements of one block); pairs go on axis 0, the only axis allowed
more than 65535 programs.

Contract (as in the engine, where CoW sources are shared blocks and destinations freshly allocated ones): the
destinations are distinct and no destination is also a source, so no program reads what another writes and
the order of pairs does not matter. A source may repeat (one shared block copied for several forks). The
launcher checks this, and that every id is inside the pool, when block_mapping is on the CPU (free); on a GPU
the check would cost a device-to-host sync per call, so it is skipped there and out-of-range ids are the
caller's bug, as with indexing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels.triton_common import (
    check_contiguous,
    check_float_dtype,
    check_int_dtype,
    check_ndim,
    check_same_device,
)

_FN = "copy_blocks"
_MAX_CHUNK = 4096  # elements per program: 8 KiB of bf16, 16 KiB of fp32


@triton.jit
def _copy_blocks_kernel(
    base_ptr,
    cache_offsets_ptr,
    block_mapping_ptr,
    stride_mapping_pair,
    stride_mapping_side,
    OFFSET_UNIT: tl.constexpr,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(block_mapping_ptr + pair * stride_mapping_pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + pair * stride_mapping_pair + stride_mapping_side).to(tl.int64)
    cache_start = tl.load(cache_offsets_ptr + cache) * OFFSET_UNIT  # elements from base_ptr to this cache
    elems = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = elems < BLOCK_NUMEL
    values = tl.load(base_ptr + cache_start + src * BLOCK_NUMEL + elems, mask=mask)
    tl.store(base_ptr + cache_start + dst * BLOCK_NUMEL + elems, values, mask=mask)


def _check_caches(key_caches, value_caches) -> list[torch.Tensor]:
    if len(key_caches) != len(value_caches):
        raise ValueError(f"{_FN}: {len(key_caches)} key caches but {len(value_caches)} value caches")
    caches = [*key_caches, *value_caches]
    if not caches:
        raise ValueError(f"{_FN}: needs at least one layer's caches")
    first = caches[0]
    names = [f"key_caches[{i}]" for i in range(len(key_caches))]
    names += [f"value_caches[{i}]" for i in range(len(value_caches))]
    for name, cache in zip(names, caches):
        check_ndim(_FN, name, cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
        if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
            raise ValueError(
                f"{_FN}: {name} is {tuple(cache.shape)} {cache.dtype} on {cache.device}, but key_caches[0] is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}: all caches must match"
            )
        check_contiguous(_FN, name, cache)
    check_float_dtype(_FN, "key_caches[0]", first)
    return caches


def _check_mapping(block_mapping: torch.Tensor, num_blocks: int) -> None:
    check_ndim(_FN, "block_mapping", block_mapping, 2, "[N, 2] rows of (src, dst)")
    if block_mapping.shape[1] != 2:
        raise ValueError(f"{_FN}: block_mapping must be [N, 2] rows of (src, dst), got {tuple(block_mapping.shape)}")
    check_int_dtype(_FN, "block_mapping", block_mapping, (torch.int64, torch.int32))
    if block_mapping.device.type != "cpu" or block_mapping.numel() == 0:
        return  # on a GPU the value checks below would sync the host; see the module docstring
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    if bool((block_mapping < 0).any()) or bool((block_mapping >= num_blocks).any()):
        raise ValueError(f"{_FN}: block ids must be in [0, {num_blocks}), got {block_mapping.tolist()}")
    if dst.unique().numel() != dst.numel():
        raise ValueError(f"{_FN}: destination blocks must be distinct, got {dst.tolist()}")
    if bool(torch.isin(dst, src).any()):
        raise ValueError(f"{_FN}: a destination block is also a source (chained copies are not supported)")


def _cache_offsets(caches: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Each cache's start relative to caches[0], in units of OFFSET_UNIT elements, and OFFSET_UNIT."""
    elem_bytes = caches[0].element_size()
    base = caches[0].data_ptr()
    block_numel = caches[0][0].numel()
    vec = 16 // elem_bytes
    aligned = all(c.data_ptr() % 16 == 0 for c in caches) and block_numel % vec == 0
    unit = vec if aligned else 1
    offsets = [(c.data_ptr() - base) // (elem_bytes * unit) for c in caches]
    return torch.tensor(offsets, dtype=torch.int64).to(caches[0].device, non_blocking=True), unit


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Copy whole blocks within each layer's caches: block_mapping [N, 2] rows (src, dst). In place.

    Destinations must be distinct and disjoint from the sources (checked when block_mapping is on the CPU).
    """
    caches = _check_caches(key_caches, value_caches)
    check_same_device(_FN, key_caches_0=caches[0], block_mapping=block_mapping)
    num_blocks = caches[0].shape[0]
    _check_mapping(block_mapping, num_blocks)
    num_pairs = block_mapping.shape[0]
    block_numel = caches[0][0].numel()
    if num_pairs == 0 or block_numel == 0:
        return
    offsets, unit = _cache_offsets(caches)
    chunk = min(_MAX_CHUNK, triton.next_power_of_2(block_numel))
    grid = (num_pairs, len(caches), triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        caches[0],
        offsets,
        block_mapping,
        block_mapping.stride(0),
        block_mapping.stride(1),
        OFFSET_UNIT=unit,
        BLOCK_NUMEL=block_numel,
        CHUNK=chunk,
        num_warps=4,
    )
