"""rms_norm, head_rms_norm (also Gemma's unit_offset), rotary_embedding, silu_and_mul and gelu_tanh_and_mul against
the reference."""

from __future__ import annotations

import pytest
import torch
from paged_cases import assert_close

from pagedq.kernels import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(ops, device, dtype, with_residual):
    hidden = 300  # not a power of two: the row mask matters
    x = (torch.randn(5, hidden) * 3).to(dtype).to(device)
    weight = (torch.rand(hidden) + 0.5).to(dtype).to(device)
    residual = torch.randn(5, hidden).to(dtype).to(device) if with_residual else None
    normed, new_residual = ops.rms_norm(x, weight, 1e-6, residual)
    expected_normed, expected_residual = reference.rms_norm(x, weight, 1e-6, residual)
    assert_close(normed, expected_normed)
    assert_close(new_residual, expected_residual)
    if not with_residual:
        assert new_residual is x


def test_rms_norm_fp32_weight_promotes_and_reads_strided_rows(ops, device):
    base = torch.randn(4, 2 * 256).to(torch.bfloat16).to(device)
    x, residual = base[:, :256], base[:, 256:]
    weight = torch.randn(256, device=device)
    normed, new_residual = ops.rms_norm(x, weight, 1e-5, residual)
    expected_normed, expected_residual = reference.rms_norm(x, weight, 1e-5, residual)
    assert normed.dtype == torch.float32
    # normed is fp32 but derived from bf16-rounded values, so it inherits bf16-level differences.
    assert_close(normed, expected_normed, dtype=torch.bfloat16)
    assert_close(new_residual, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_head_rms_norm_matches_reference(ops, device, dtype, head_dim):
    qkv = torch.randn(6, (3 + 2) * head_dim).to(dtype).to(device)
    x = qkv[:, : 3 * head_dim].view(6, 3, head_dim)  # strided view, as q is sliced from qkv
    weight = (torch.rand(head_dim) + 0.5).to(dtype).to(device)
    out = ops.head_rms_norm(x, weight, 1e-6)
    assert_close(out, reference.head_rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_unit_offset_matches_reference(ops, device, dtype, with_residual):
    hidden = 300
    x = (torch.randn(5, hidden) * 3).to(dtype).to(device)
    weight = (torch.randn(hidden) * 0.5).to(dtype).to(device)  # Gemma stores weight - 1: around 0
    residual = torch.randn(5, hidden).to(dtype).to(device) if with_residual else None
    normed, new_residual = ops.rms_norm(x, weight, 1e-6, residual, unit_offset=True)
    expected_normed, expected_residual = reference.rms_norm(x, weight, 1e-6, residual, unit_offset=True)
    assert normed.dtype == dtype
    assert_close(normed, expected_normed)
    assert_close(new_residual, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_rms_norm_unit_offset_matches_reference(ops, device, dtype):
    head_dim = 96
    qkv = torch.randn(6, (3 + 2) * head_dim).to(dtype).to(device)
    x = qkv[:, : 3 * head_dim].view(6, 3, head_dim)
    weight = (torch.randn(head_dim) * 0.5).to(dtype).to(device)
    out = ops.head_rms_norm(x, weight, 1e-6, unit_offset=True)
    assert out.dtype == dtype
    assert_close(out, reference.head_rms_norm(x, weight, 1e-6, unit_offset=True))


def _cos_sin_cache(max_pos: int, head_dim: int, device) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=1).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", [(64, 4, 1), (128, 8, 2), (96, 6, 3)])
def test_rotary_matches_reference_and_keeps_inputs(ops, device, dtype, head_dim, num_q_heads, num_kv_heads):
    tokens = 7
    qkv = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim).to(dtype).to(device)
    query = qkv[:, : num_q_heads * head_dim].view(tokens, num_q_heads, head_dim)
    key = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 200, (tokens,), device=device)
    cos_sin = _cos_sin_cache(200, head_dim, device)
    before = qkv.clone()
    out_q, out_k = ops.rotary_embedding(query, key, positions, cos_sin)
    expected_q, expected_k = reference.rotary_embedding(query, key, positions, cos_sin)
    assert_close(out_q, expected_q)
    assert_close(out_k, expected_k)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [600, 2100])
def test_silu_and_mul_matches_reference(ops, device, dtype, intermediate):
    gate_up = (torch.randn(3, 2 * intermediate) * 4).to(dtype).to(device)
    out = ops.silu_and_mul(gate_up)
    assert_close(out, reference.silu_and_mul(gate_up))


def test_silu_and_mul_strided_rows(ops, device):
    base = torch.randn(4, 3 * 128, device=device)
    gate_up = base[:, : 2 * 128]
    assert_close(ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [600, 2100])
def test_gelu_tanh_and_mul_matches_reference(ops, device, dtype, intermediate):
    # * 4 reaches both tails, where the activation is ~0 and ~the identity
    gate_up = (torch.randn(3, 2 * intermediate) * 4).to(dtype).to(device)
    out = ops.gelu_tanh_and_mul(gate_up)
    assert_close(out, reference.gelu_tanh_and_mul(gate_up))


def test_gelu_tanh_reference_is_transformers_gelu_pytorch_tanh():
    from transformers.activations import ACT2FN

    gate_up = torch.randn(5, 2 * 64) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(reference.gelu_tanh_and_mul(gate_up), ACT2FN["gelu_pytorch_tanh"](gate) * up)


def test_gelu_tanh_and_mul_strided_rows_and_extremes(ops, device):
    base = torch.randn(4, 3 * 128, device=device)
    base[0, :128] = torch.linspace(-60.0, 60.0, 128)  # exp(-2u) overflows at one end, vanishes at the other
    gate_up = base[:, : 2 * 128]
    out = ops.gelu_tanh_and_mul(gate_up)
    assert torch.isfinite(out).all()
    assert_close(out, reference.gelu_tanh_and_mul(gate_up.contiguous()))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda ops, d: ops.rms_norm(torch.randn(2, 8, device=d), torch.randn(7, device=d), 1e-6),
         r"^rms_norm: weight must be \[8\] to match x \(2, 8\), got \(7,\)"),
        (lambda ops, d: ops.rms_norm(torch.randn(2, 8, device=d), torch.randn(8, device=d), 1e-6,
                                     torch.randn(2, 8, device=d).half()),
         r"^rms_norm: residual must match x"),
        (lambda ops, d: ops.head_rms_norm(torch.randn(2, 8, device=d), torch.randn(8, device=d), 1e-6),
         r"^head_rms_norm: x must be \[T, Hh, D\], got shape \(2, 8\)"),
        (lambda ops, d: ops.silu_and_mul(torch.randn(2, 7, device=d)),
         r"^silu_and_mul: gate_up must be \[T, 2I\] with an even last dim"),
        (lambda ops, d: ops.silu_and_mul(torch.randn(8, 2, device=d).t()),
         r"^silu_and_mul: gate_up must have a contiguous last dimension"),
        (lambda ops, d: ops.gelu_tanh_and_mul(torch.randn(2, 7, device=d)),
         r"^gelu_tanh_and_mul: gate_up must be \[T, 2I\] with an even last dim"),
        (lambda ops, d: ops.rotary_embedding(torch.randn(2, 2, 8, device=d), torch.randn(2, 1, 8, device=d),
                                             torch.zeros(2, dtype=torch.long, device=d), torch.randn(4, 6, device=d)),
         r"^rotary_embedding: cos_sin_cache must be \[max_pos, 8\]"),
        (lambda ops, d: ops.rotary_embedding(torch.randn(2, 2, 8, device=d), torch.randn(2, 1, 8, device=d),
                                             torch.zeros(2, device=d), torch.randn(4, 8, device=d)),
         r"^rotary_embedding: positions must be int64 or int32"),
    ],
)  # fmt: skip
def test_elementwise_rejects_bad_arguments(ops, device, call, message):
    with pytest.raises(ValueError, match=message):
        call(ops, device)
