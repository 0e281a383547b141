"""gumbel_argmax: fused temperature + counter-based Gumbel noise + argmax over the vocabulary, one pass.

Shapes and strides
    logits       [B, V] fp32, last dim contiguous (row stride free); filtered tokens hold -inf
    temperature  [B] fp32 (0 = greedy)
    seeds        [B] int64, positions [B] int64 (index of the output token being drawn)
    -> token_ids [B] int64

Math (kernels.reference.gumbel_argmax is the torch version): for each row b
    T_b == 0:  argmax_v logits[b, v]
    else:      argmax_v logits[b, v] / max(T_b, 1e-6) + g(seed_b, position_b, v),  over v with logits > -inf
where g is kernels.reference.gumbel_noise, bit for bit: MurmurHash3 fmix32 on uint32 lanes, the top 23 bits as
u = (bits + 0.5) / 2**23 in fp32, g = -log(-log(u)) in fp32. The division is round-to-nearest (tl.div_rn, as
torch), not Triton's default approximate one. Ties go to the lowest token id, as torch.argmax.

Grid (B, S): the vocabulary of each row is split into S contiguous slices so that small decode batches still
fill the GPU. Each program walks its slice in tiles of BLOCK_V with a running (max, argmax), and writes one
partial; a second tiny kernel picks, per row, the first slice holding the largest partial. S = 1 on CPU.

log: compiled, tl.log is libdevice's __nv_logf, the logf torch's CUDA kernels call, so g matches torch on
CUDA. Under Triton's interpreter tl.log is numpy's log, which differs from torch's CPU log in the last bit
for about a fifth of the inputs; the interpreter build therefore computes the log with torch, so the
noise stays bit-identical to the torch function on CPU as well and the tests can check it exactly.

23 bits (not 24) keep u strictly below 1: 2**24 - 1 + 0.5 would round up to 2**24 in fp32, giving +inf noise.
Filtered tokens (-inf) are masked explicitly rather than trusted to stay -inf after adding the noise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels.triton_common import (
    check_int_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    padded_pow2,
    runs_in_interpreter,
)

_FN = "gumbel_argmax"
BLOCK_V = 1024
MAX_SPLITS = 64


@triton.jit
def _fmix32(h):
    """MurmurHash3's 32-bit finaliser on uint32 (products wrap mod 2**32)."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _row_key(seed, position):
    """uint32 key of (seed, position), as kernels.reference.gumbel_noise's row_key."""
    seed_hi = (seed >> 32).to(tl.uint32)
    seed_lo = seed.to(tl.uint32)
    key = _fmix32(_fmix32(seed_hi) ^ seed_lo)
    return _fmix32(key ^ _fmix32(position.to(tl.uint32)))


@triton.jit
def _tl_log(x):
    return tl.log(x)


def _interpreter_torch_log(x):
    """Interpreter only: tl.log's numpy log, replaced by torch's CPU log (see the module docstring)."""
    from triton.runtime.interpreter import TensorHandle

    data = torch.from_numpy(x.handle.data).log().numpy()
    return tl.tensor(TensorHandle(data, x.dtype.scalar), x.type)


_device_log = _interpreter_torch_log if runs_in_interpreter(_tl_log) else _tl_log


@triton.jit
def _gumbel(row_key, tokens):
    """fp32 Gumbel noise of token ids `tokens` (int32 tensor) in the row keyed by `row_key`."""
    lanes = tokens.to(tl.uint32) * 0x9E3779B9
    bits = _fmix32(_fmix32(row_key ^ lanes))
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # exact: a power of two
    return -_device_log(-_device_log(uniform))


@triton.jit
def _slice_argmax(row_ptr, start, stop, temperature, row_key, WITH_NOISE: tl.constexpr, BLOCK: tl.constexpr):
    """(max, first argmax) of the scores of tokens [start, stop); (-inf, start) when all are -inf."""
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = start
    for tile in range(start, stop, BLOCK):
        tokens = tile + tl.arange(0, BLOCK)
        logits = tl.load(row_ptr + tokens, mask=tokens < stop, other=float("-inf"))
        scores = logits
        if WITH_NOISE:
            noise = _gumbel(row_key, tokens)  # may be +inf: a filtered token gets 0, never -inf + inf = NaN
            scores = tl.div_rn(logits, temperature) + tl.where(logits == float("-inf"), 0.0, noise)
        tile_val, tile_idx = tl.max(scores, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = tile_val > best_val
        best_idx = tl.where(better, tile + tile_idx, best_idx)
        best_val = tl.where(better, tile_val, best_val)
    return best_val, best_idx


@triton.jit
def _gumbel_argmax_partial_kernel(
    logits_ptr, temperature_ptr, seeds_ptr, positions_ptr, partial_val_ptr, partial_idx_ptr,
    vocab_size, stride_logits_row, slice_len,
    NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    start = split * slice_len
    stop = tl.minimum(start + slice_len, vocab_size)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_logits_row
    temperature = tl.load(temperature_ptr + row)
    if temperature == 0:
        best_val, best_idx = _slice_argmax(row_ptr, start, stop, temperature, 0, False, BLOCK)
    else:
        row_key = _row_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
        temperature = tl.maximum(temperature, 1e-6)
        best_val, best_idx = _slice_argmax(row_ptr, start, stop, temperature, row_key, True, BLOCK)
    tl.store(partial_val_ptr + row * NUM_SPLITS + split, best_val)
    tl.store(partial_idx_ptr + row * NUM_SPLITS + split, best_idx)


@triton.jit
def _gumbel_argmax_reduce_kernel(partial_val_ptr, partial_idx_ptr, out_ptr, NUM_SPLITS: tl.constexpr,
                                 SPLITS_PAD: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS_PAD)
    mask = splits < NUM_SPLITS
    vals = tl.load(partial_val_ptr + row * NUM_SPLITS + splits, mask=mask, other=float("-inf"))
    idxs = tl.load(partial_idx_ptr + row * NUM_SPLITS + splits, mask=mask, other=0)
    _, best_split = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    best = tl.sum(tl.where(splits == best_split, idxs, 0), axis=0)
    tl.store(out_ptr + row, best.to(tl.int64))


@triton.jit
def _gumbel_noise_kernel(seeds_ptr, positions_ptr, out_ptr, vocab_size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row_key = _row_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
    noise = _gumbel(row_key, tokens)
    tl.store(out_ptr + row.to(tl.int64) * vocab_size + tokens, noise, mask=tokens < vocab_size)


def _check_row_vectors(num_rows: int, **vectors: torch.Tensor) -> None:
    for name, tensor in vectors.items():
        check_ndim(_FN, name, tensor, 1, "[B]")
        if tensor.shape[0] != num_rows:
            raise ValueError(f"{_FN}: {name} has {tensor.shape[0]} entries for {num_rows} rows")


def _check_sampling_args(logits, temperature, seeds, positions) -> None:
    check_ndim(_FN, "logits", logits, 2, "[B, V]")
    if logits.dtype != torch.float32:
        raise ValueError(f"{_FN}: logits must be float32, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError(f"{_FN}: logits has an empty vocabulary, shape {tuple(logits.shape)}")
    check_last_dim_contiguous(_FN, "logits", logits)
    _check_row_vectors(logits.shape[0], temperature=temperature, seeds=seeds, positions=positions)
    if temperature.dtype != torch.float32:
        raise ValueError(f"{_FN}: temperature must be float32, got {temperature.dtype}")
    check_int_dtype(_FN, "seeds", seeds, (torch.int64,))
    check_int_dtype(_FN, "positions", positions, (torch.int64,))
    check_same_device(_FN, logits=logits, temperature=temperature, seeds=seeds, positions=positions)


def _default_splits(num_rows: int, vocab_size: int, device: torch.device) -> int:
    """Enough programs to give every SM about four, never slices shorter than two tiles."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(4 * sms, max(num_rows, 1))
    return max(1, min(MAX_SPLITS, wanted, triton.cdiv(vocab_size, 2 * BLOCK_V)))


def gumbel_argmax(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """[B] int64 token ids: argmax_v logits[b, v] / max(T_b, 1e-6) + gumbel_noise(seeds, positions)[b, v],
    or argmax_v logits[b, v] where T_b == 0. Tokens with logit -inf are never chosen (an all -inf row gives 0).
    logits [B, V] fp32, temperature [B] fp32, seeds/positions [B] int64."""
    return gumbel_argmax_split(logits, temperature, seeds, positions, None)


def gumbel_argmax_split(logits, temperature, seeds, positions, num_splits: int | None) -> torch.Tensor:
    """gumbel_argmax with `num_splits` slices of the vocabulary per row (None: from the GPU's SM count).
    A tuning knob only: the result never depends on it (the tests run every split count against one answer)."""
    _check_sampling_args(logits, temperature, seeds, positions)
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    splits = num_splits or _default_splits(num_rows, vocab_size, logits.device)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"{_FN}: num_splits must be in [1, {MAX_SPLITS}], got {splits}")
    slice_len = triton.cdiv(triton.cdiv(vocab_size, splits), BLOCK_V) * BLOCK_V  # whole tiles per slice
    splits = triton.cdiv(vocab_size, slice_len)
    partial_val = torch.empty(num_rows, splits, dtype=torch.float32, device=logits.device)
    partial_idx = torch.empty(num_rows, splits, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_partial_kernel[(num_rows, splits)](
        logits, temperature.contiguous(), seeds.contiguous(), positions.contiguous(), partial_val, partial_idx,
        vocab_size, logits.stride(0), slice_len,
        NUM_SPLITS=splits, BLOCK=BLOCK_V, num_warps=4,
    )  # fmt: skip
    _gumbel_argmax_reduce_kernel[(num_rows,)](
        partial_val, partial_idx, out, NUM_SPLITS=splits, SPLITS_PAD=padded_pow2(splits), num_warps=1
    )
    return out


def gumbel_noise_triton(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] fp32: the kernel's noise, materialised (for tests; the sampler never needs it)."""
    _check_row_vectors(seeds.shape[0] if seeds.dim() == 1 else -1, seeds=seeds, positions=positions)
    check_int_dtype(_FN, "seeds", seeds, (torch.int64,))
    check_int_dtype(_FN, "positions", positions, (torch.int64,))
    out = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    if out.numel():
        grid = (seeds.shape[0], triton.cdiv(vocab_size, BLOCK_V))
        _gumbel_noise_kernel[grid](seeds.contiguous(), positions.contiguous(), out, vocab_size, BLOCK=BLOCK_V)
    return out
