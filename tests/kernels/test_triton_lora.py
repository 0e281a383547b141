"""Triton lora_shrink / lora_expand and lora_add, their composition, against the torch reference (`kernels.lora`),
per dtype, under the interpreter."""

from __future__ import annotations

import pytest
import torch
from lora_cases import CASES, TOLERANCES, make_case

from pagedq.kernels import lora
from pagedq.kernels.lora import LoRAIndex

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_shrink_and_expand_match_the_reference(ops, device, name, dtype):
    case = make_case(name, dtype, device)
    index = LoRAIndex.build(case.slots, case.num_slots, device)
    buf = ops.lora_shrink(case.x, case.lora_a, index)
    expected_buf = lora.lora_shrink(case.x, case.lora_a, index)
    assert buf.dtype == torch.float32
    atol, rtol = TOLERANCES[dtype] if dtype != torch.float32 else (1e-5, 1e-5)
    torch.testing.assert_close(buf, expected_buf, atol=atol, rtol=rtol)
    base = (case.slots < 0).to(device)
    assert not buf[:, base].any()
    y, expected = case.y.clone(), case.y.clone()
    ops.lora_expand(y, expected_buf, case.lora_b, index, case.out_sizes)
    lora.lora_expand(expected, expected_buf, case.lora_b, index, case.out_sizes)
    assert y.dtype == dtype
    torch.testing.assert_close(y, expected, atol=atol, rtol=rtol)
    assert torch.equal(y[base], case.y[base])
    added = case.y.clone()
    ops.lora_add(added, case.x, case.lora_a, case.lora_b, index, case.out_sizes)  # the layer's call: both kernels
    torch.testing.assert_close(added, expected, atol=atol, rtol=rtol)


def test_prefill_segments_span_several_row_tiles(ops, device):
    """Segments longer than one 64-row tile, a packed N=2 linear with unequal slices, rank 40 (two rank tiles of
    shrink's output), fp16."""
    gen = torch.Generator().manual_seed(1)
    slots = torch.tensor([0] * 70 + [-1] * 5 + [2] * 3 + [0] * 2, dtype=torch.int32)[torch.randperm(80, generator=gen)]
    index = LoRAIndex.build(slots, 3, device)
    assert index.max_segment_length == 72
    x = torch.randn(80, 40, generator=gen).to(device, torch.float16)
    lora_a = (torch.randn(3, 2, 40, 40, generator=gen) / 8).to(device, torch.float16)
    lora_b = (torch.randn(3, 2, 48, 40, generator=gen) / 8).to(device, torch.float16)
    buf = ops.lora_shrink(x, lora_a, index)
    torch.testing.assert_close(buf, lora.lora_shrink(x, lora_a, index), atol=2e-3, rtol=2e-3)
    y = torch.randn(80, 80, generator=gen).to(device, torch.float16)
    expected = y.clone()
    ops.lora_expand(y, buf, lora_b, index, (48, 32))
    lora.lora_expand(expected, buf, lora_b, index, (48, 32))
    torch.testing.assert_close(y, expected, atol=2e-3, rtol=2e-3)


def test_a_static_index_gives_the_same_result(ops, device):
    """The CUDA-graph form: a grid over T rows per slot, refilled in place, equals the step's own index."""
    case = make_case("mixed_qkv_gqa", torch.float32, device)
    step = LoRAIndex.build(case.slots, case.num_slots, device)
    static = LoRAIndex.static(len(case.slots), case.num_slots, device)
    static.copy_from(step)
    buf = ops.lora_shrink(case.x, case.lora_a, static)
    torch.testing.assert_close(buf, ops.lora_shrink(case.x, case.lora_a, step), atol=0, rtol=0)
    y, expected = case.y.clone(), case.y.clone()
    ops.lora_expand(y, buf, case.lora_b, static, case.out_sizes)
    ops.lora_expand(expected, buf, case.lora_b, step, case.out_sizes)
    torch.testing.assert_close(y, expected, atol=0, rtol=0)


def test_mismatched_dtypes_are_refused(ops, device):
    case = make_case("single_token", torch.float32, device)
    index = LoRAIndex.build(case.slots, case.num_slots, device)
    with pytest.raises(ValueError, match=r"lora_a dtype torch\.float16 must match x dtype torch\.float32"):
        ops.lora_shrink(case.x, case.lora_a.half(), index)
