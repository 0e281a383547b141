"""The CPU's matrix product of a few rows: x @ weight.T computed as (weight @ x.T).T.

torch's F.linear (x @ weight^T) of a few rows is slower than the same product in that layout on the CPU's BLAS;
decode steps, verify rows and an expert's share of a decode batch live in that range, prefill does not
(docs/benchmarks.md#cpu-few-row-products). The engine's linear layers and the CPU MoE path both use it.
"""

from __future__ import annotations

import torch

# Rows up to which the few-row layout is used (one row: F.linear is as fast)
CPU_FEW_ROWS = 128


def uses_few_row_layout(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dim() == 2 and 2 <= x.shape[0] <= CPU_FEW_ROWS


def cpu_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [N, in] @ weight [out, in].T (+ bias), row-major (in-place users need it), written into `out` if given:
    in the few-row layout for 2..CPU_FEW_ROWS rows on the CPU, else as F.linear computes it (without its copy)."""
    if not uses_few_row_layout(x):
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)
    # the bias added inside the product, as F.linear's addmm does (in half precision a separate add rounds twice)
    product = (torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight, x.t())).t()
    if out is not None:
        return out.copy_(product)
    return product.contiguous()
