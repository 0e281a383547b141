"""Helpers shared by the Triton kernels: launcher checks, the interpreter workaround for tl.dot, padding sizes.

Nothing here launches a kernel. The launchers in the sibling modules use these to validate their arguments
with messages that name the public function and the offending tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def runs_in_interpreter(kernel) -> bool:
    """True when `kernel` was defined under TRITON_INTERPRET=1 (Triton then returns a non-JIT wrapper)."""
    return not isinstance(kernel, JITFunction)


def needs_dot_upcast(kernel, dtype: torch.dtype) -> bool:
    """Whether tl.dot operands of `dtype` must be widened to fp32 before the product.

    Triton's interpreter stores bf16 as raw uint16 and multiplies those integers in tl.dot (3.6 through 3.9),
    so bf16 dots are garbage there. Widening bf16 to fp32 and multiplying in IEEE fp32 gives exactly the
    products a bf16 tensor-core MMA accumulates in fp32, so the interpreter still tests the same math.
    On a GPU this is always False and the native bf16 MMA runs.
    """
    return dtype == torch.bfloat16 and runs_in_interpreter(kernel)


@triton.jit
def dot_fp32_acc(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation; IEEE fp32 (not TF32) when the operands are fp32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


def needs_bf16_rounding_by_hand(kernel, dtype: torch.dtype) -> bool:
    """Whether fp32 -> `dtype` casts must round to nearest even by hand (`round_to`).

    Triton's interpreter (3.7 here) truncates fp32 -> bf16 where the GPU and torch round to nearest even;
    a kernel that rounds several intermediates as its torch reference does would drift a few ulps low there.
    On a GPU this is always False and the plain cast rounds.
    """
    return dtype == torch.bfloat16 and runs_in_interpreter(kernel)


@triton.jit
def round_to(x, dtype: tl.constexpr, BY_HAND: tl.constexpr):
    """fp32 x rounded to nearest even in `dtype`; BY_HAND (bf16 in the interpreter only) rounds the fp32 bits to
    their top 16 first, so that the interpreter's truncating cast is exact. Finite values only."""
    if BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def padded_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): Triton block shapes must be powers of two."""
    return max(triton.next_power_of_2(n), minimum)


def check_float_dtype(fn: str, name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_FLOAT_DTYPES:
        raise ValueError(f"{fn}: {name} must be float32, float16 or bfloat16, got {tensor.dtype}")


def check_int_dtype(fn: str, name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{fn}: {name} must be {names}, got {tensor.dtype}")


def check_ndim(fn: str, name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{fn}: {name} must be {layout}, got shape {tuple(tensor.shape)}")


def check_contiguous(fn: str, name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous, got strides {tensor.stride()}")


def check_last_dim_contiguous(fn: str, name: str, tensor: torch.Tensor) -> None:
    """Views (e.g. q/k/v sliced out of a fused qkv projection) are fine as long as rows are dense."""
    if tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{fn}: {name} must have a contiguous last dimension, got strides {tensor.stride()}")


def check_same_device(fn: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{fn}: all tensors must be on one device, got {devices}")


def check_paged_caches(fn: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both caches [num_blocks, block_size, num_kv_heads, head_dim], same shape/dtype, contiguous."""
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    check_ndim(fn, "k_cache", k_cache, 4, layout)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{fn}: v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{fn}: v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    check_float_dtype(fn, "k_cache", k_cache)
    check_contiguous(fn, "k_cache", k_cache)
    check_contiguous(fn, "v_cache", v_cache)


def check_paged_attention_inputs(fn: str, query, k_cache, v_cache, block_tables, layout: str) -> None:
    """The checks both paged attention launchers share: the caches, the query against them, the block tables."""
    check_paged_caches(fn, k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    check_ndim(fn, "query", query, 3, layout)
    if query.shape[2] != head_dim or query.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"{fn}: query must be {layout} with D = {head_dim} and Hq a multiple of the cache's "
            f"{num_kv_heads} KV heads, got {tuple(query.shape)}"
        )
    check_float_dtype(fn, "query", query)
    if query.dtype != k_cache.dtype:
        raise ValueError(f"{fn}: query dtype {query.dtype} must match the cache dtype {k_cache.dtype}")
    check_last_dim_contiguous(fn, "query", query)
    check_ndim(fn, "block_tables", block_tables, 2, "[S, max_blocks]")
    check_int_dtype(fn, "block_tables", block_tables, (torch.int32,))
    if block_tables.stride(-1) != 1:
        raise ValueError(f"{fn}: block_tables rows must be contiguous, got strides {block_tables.stride()}")


@triton.jit
def paged_kv_offsets(
    table_row,
    positions,
    mask,
    dims,
    kv_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
):
    """Element offsets [N, D] of one sequence's cached K/V rows at `positions` [N], found through its block
    table row: page = table[pos // BLOCK_SIZE], slot = pos % BLOCK_SIZE. Masked positions read page 0."""
    blocks = tl.load(table_row + positions // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    token_offsets = blocks * stride_cache_block + (positions % BLOCK_SIZE) * stride_cache_slot
    return (token_offsets + kv_head * stride_cache_head)[:, None] + dims[None, :]


LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionVariant:
    """The attention kernels' variant arguments (pagedq/kernels/reference.py defines them), checked and laid out
    for a launch: the constexpr switches (a kernel without a feature compiles without its code), the base-2 score
    factors, and the sinks as [Hq] fp32 (the query itself stands in when there are none: never read)."""

    window: int
    has_window: bool
    softcap: bool
    scale_log2: float  # scores = dots * scale_log2 without a soft-cap
    cap_inner: float  # with one: scores = softcap * log2(e) * tanh(dots * scale / softcap) = cap_outer * tanh(...)
    cap_outer: float
    has_sinks: bool
    sinks: torch.Tensor

    @classmethod
    def of(
        cls, fn: str, query: torch.Tensor, scale: float, window: int, softcap: float, sinks: torch.Tensor | None
    ) -> AttentionVariant:
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            raise ValueError(f"{fn}: window must be an integer >= 0 (0: full attention), got {window!r}")
        if not (0 <= softcap < float("inf")):
            raise ValueError(f"{fn}: softcap must be a finite number >= 0 (0: none), got {softcap!r}")
        if sinks is not None:
            if sinks.shape != (query.shape[1],) or sinks.device != query.device:
                raise ValueError(
                    f"{fn}: sinks must be [Hq] = [{query.shape[1]}] on {query.device}, got {tuple(sinks.shape)} "
                    f"on {sinks.device}"
                )
            sinks = sinks.to(torch.float32).contiguous()
        cap_inner, cap_outer = (scale / softcap, softcap * LOG2E) if softcap else (1.0, 1.0)
        return cls(
            window, window > 0, softcap > 0, scale * LOG2E, cap_inner, cap_outer, sinks is not None,
            query if sinks is None else sinks,
        )  # fmt: skip


@triton.jit
def scaled_scores(dots, scale_log2, cap_inner, cap_outer, SOFTCAP: tl.constexpr):
    """Attention scores in base 2 from q.k dot products: dots * scale * log2(e), or with a soft-cap
    softcap * tanh(dots * scale / softcap) * log2(e). tanh(x) = 1 - 2 / (exp(2x) + 1), through exp2 (which every
    Triton backend has): exp2 overflowing to inf gives 1, underflowing to 0 gives -1."""
    if SOFTCAP:
        tanh = 1.0 - 2.0 / (tl.exp2(dots * cap_inner * (2.0 * 1.4426950408889634)) + 1.0)
        return tanh * cap_outer
    else:
        return dots * scale_log2
