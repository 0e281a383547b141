"""silu_and_mul and gelu_tanh_and_mul: the SwiGLU and GeGLU activations of a fused gate/up projection.

Shapes and strides
    gate_up [T, 2I]   (gate | up) packed along the last dim; rows may be strided, last dim contiguous
    -> out  [T, I]    same dtype, contiguous

Math: out = act(gate) * up, act computed in fp32 and rounded to the input dtype before the multiply, because
torch's activation returns the input dtype and the reference multiplies the rounded value.
    silu(g) = g / (1 + exp(-g))
    gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3)   (torch's approximate="tanh",
                 transformers' gelu_pytorch_tanh), computed as g / (1 + exp(-2u)): the same function, since
                 (1 + tanh(u)) / 2 = sigmoid(2u), without tanh's cancellation near u = 0

Grid (T, cdiv(I, BLOCK)): I is 10k-30k in common models, so 1k-element blocks give enough programs even for
a single decode token, and each thread moves 16-byte vectors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels.triton_common import check_float_dtype, check_last_dim_contiguous

BLOCK_ELEMENTS = 1024


SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_row, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    row_ptr = gate_up_ptr + row.to(tl.int64) * stride_row
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    out = activated * up
    tl.store(out_ptr + row.to(tl.int64) * INTERMEDIATE + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_and_mul_kernel(gate_up_ptr, out_ptr, stride_row, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    row_ptr = gate_up_ptr + row.to(tl.int64) * stride_row
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    inner = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
    activated = (gate / (1.0 + tl.exp(-2.0 * inner))).to(out_ptr.dtype.element_ty).to(tl.float32)
    out = activated * up
    tl.store(out_ptr + row.to(tl.int64) * INTERMEDIATE + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] packed (gate | up) -> silu(gate) * up, [T, I]."""
    return _gated(gate_up, "silu_and_mul", _silu_and_mul_kernel)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] packed (gate | up) -> gelu(gate, approximate="tanh") * up, [T, I]."""
    return _gated(gate_up, "gelu_tanh_and_mul", _gelu_tanh_and_mul_kernel)


def _gated(gate_up: torch.Tensor, fn: str, kernel: triton.JITFunction) -> torch.Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 != 0:
        raise ValueError(f"{fn}: gate_up must be [T, 2I] with an even last dim, got shape {tuple(gate_up.shape)}")
    check_float_dtype(fn, "gate_up", gate_up)
    check_last_dim_contiguous(fn, "gate_up", gate_up)
    num_rows, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0 or intermediate == 0:
        return out
    block = min(BLOCK_ELEMENTS, triton.next_power_of_2(intermediate))
    kernel[(num_rows, triton.cdiv(intermediate, block))](
        gate_up, out, gate_up.stride(0), INTERMEDIATE=intermediate, BLOCK=block, num_warps=4
    )
    return out
