"""pagedq.engine.layers.Linear: the CPU's few-row product (weight @ x^T) against torch's F.linear."""

from __future__ import annotations

import pytest
import torch

from pagedq.engine.layers.linear import Linear, PackedLinear
from pagedq.kernels.cpu_linear import CPU_FEW_ROWS


@pytest.mark.parametrize("rows", [1, 2, 5, 17, CPU_FEW_ROWS, CPU_FEW_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_f_linear(rows, bias, dtype):
    torch.manual_seed(rows)
    layer = Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    out = layer(x)
    expected = torch.nn.functional.linear(x.float(), layer.weight.float(), None if not bias else layer.bias.float())
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    assert out.shape == (rows, 160) and out.dtype == dtype and out.is_contiguous()


def test_packed_linear_takes_the_same_path():
    layer = PackedLinear(32, [16, 8, 8], bias=True)
    x = torch.randn(4, 32)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    with torch.inference_mode():
        batched = layer(torch.randn(3, 5, 32))  # not 2-D: torch's own path
    assert batched.shape == (3, 5, 32)
