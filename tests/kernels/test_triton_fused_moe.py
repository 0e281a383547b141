"""The Triton fused_moe (alignment + gate/up and down grouped GEMMs) against `reference.fused_moe`."""

from __future__ import annotations

import pytest
import torch
from moe_cases import CASES, MoeCase, make_experts, make_routing
from paged_cases import assert_close

from pagedq.kernels import moe, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _both(ops, hidden, experts, weights, ids, activation):
    kwargs = {"w13_bias": experts["w13_bias"], "w2_bias": experts["w2_bias"], "activation": activation}
    out = ops.fused_moe(hidden, experts["w13"], experts["w2"], weights, ids, **kwargs)
    return out, reference.fused_moe(hidden, experts["w13"], experts["w2"], weights, ids, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation,with_bias", [("silu", False), ("swiglu_oai", True)])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fused_moe_matches_reference(ops, device, dtype, activation, with_bias, case):
    hidden = torch.randn(case.tokens, case.hidden).to(dtype).to(device)
    weights, ids = make_routing(case, device, id_dtype=torch.int32)
    experts = make_experts(case, dtype, device, with_bias)
    out, expected = _both(ops, hidden, experts, weights, ids, activation)
    assert expected.abs().max() > 0.5  # not a vacuous comparison of near-zero outputs
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biases_with_silu_int64_ids_and_strided_operands(ops, device, dtype):
    """Expert weights as transposed views (gpt-oss stores [E, H, 2I] and [E, I, H]) and hidden rows sliced
    out of a wider tensor: the kernels take any weight strides and a row stride for hidden."""
    case = MoeCase(tokens=6, top_k=2, experts=4, idle_experts=(1,))
    experts = make_experts(case, dtype, device, with_bias=True)
    experts["w13"] = experts["w13"].transpose(1, 2).contiguous().transpose(1, 2)
    experts["w2"] = experts["w2"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not experts["w13"].is_contiguous() and not experts["w2"].is_contiguous()
    hidden = torch.randn(case.tokens, 2 * case.hidden).to(dtype).to(device)[:, : case.hidden]
    weights, ids = make_routing(case, device, id_dtype=torch.int64)
    out, expected = _both(ops, hidden, experts, weights, ids, "silu")
    assert_close(out, expected)


@pytest.mark.parametrize("block_m", [16, 64])
def test_alignment_groups_every_pair_under_its_expert(device, block_m):
    case = MoeCase(tokens=50, top_k=3, experts=8, idle_experts=(0, 4))
    _, ids = make_routing(case, device, id_dtype=torch.int32)
    sorted_pair_ids, block_experts = moe.align_pairs_by_expert(ids, case.experts, block_m)
    num_pairs = ids.numel()
    flat = ids.reshape(-1).tolist()
    rows, blocks = sorted_pair_ids.tolist(), block_experts.tolist()
    assert len(rows) == len(blocks) * block_m >= num_pairs + min(case.experts, num_pairs) * (block_m - 1)
    expected_blocks: list[int] = []
    expected_rows: list[int] = []
    for expert in range(case.experts):
        group = [pair for pair, e in enumerate(flat) if e == expert]
        padded = -(-len(group) // block_m) * block_m
        expected_rows += group + [num_pairs] * (padded - len(group))
        expected_blocks += [expert] * (padded // block_m)
    assert rows[: len(expected_rows)] == expected_rows
    assert all(row == num_pairs for row in rows[len(expected_rows) :])
    assert blocks == expected_blocks + [-1] * (len(blocks) - len(expected_blocks))


def test_alignment_never_reads_the_routing_back_to_the_host():
    """On meta tensors any .item()/.tolist() raises: the alignment's shapes depend on T, K and E only, so a decode
    step stays capturable in a CUDA graph."""
    sorted_pair_ids, block_experts = moe.align_pairs_by_expert(
        torch.empty(64, 8, dtype=torch.int32, device="meta"), 128, 16
    )
    assert sorted_pair_ids.shape == (64 * 8 + 128 * 15,) and block_experts.shape == ((64 * 8 + 128 * 15) // 16,)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(w13=a["w13"][:, :-1]), "w13 must be"),
        (lambda a: a.update(w2=a["w2"][:, :, :-1]), "w2 must be"),
        (lambda a: a.update(w2=a["w2"].half()), "w2 dtype"),
        (lambda a: a.update(topk_ids=a["topk_ids"].float()), "topk_ids must be int32 or int64"),
        (lambda a: a.update(topk_weights=a["topk_weights"][:, :1]), "topk_ids and topk_weights must both be"),
        (lambda a: a.update(w13_bias=torch.zeros(4, 3)), "w13_bias must be"),
        (lambda a: a.update(w13_bias=torch.zeros(4, 96, dtype=torch.float16)), "w13_bias dtype"),
        (lambda a: a.update(hidden=a["hidden"].t().contiguous().t()), "hidden must have a contiguous last dim"),
    ],
)
def test_bad_arguments_are_refused_by_name(ops, device, change, message):
    case = MoeCase(tokens=4, top_k=2, experts=4)
    experts = make_experts(case, torch.float32, device, with_bias=False)
    weights, ids = make_routing(case, device)
    args = {"hidden": torch.randn(4, case.hidden, device=device), "w13": experts["w13"], "w2": experts["w2"],
            "topk_weights": weights, "topk_ids": ids, "w13_bias": None}  # fmt: skip
    change(args)
    with pytest.raises(ValueError, match=message):
        ops.fused_moe(args["hidden"], args["w13"], args["w2"], args["topk_weights"], args["topk_ids"],
                      w13_bias=args["w13_bias"])  # fmt: skip
