"""LoRAIndex, the torch reference and the CPU (slot-grouped) path of the batched LoRA kernels."""

from __future__ import annotations

import pytest
import torch
from lora_cases import CASES, TOLERANCES, loop_expand, loop_shrink, make_case

from pagedq.kernels import bind, lora
from pagedq.kernels.lora import LoRAIndex

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_index_groups_tokens_by_slot_stably():
    index = LoRAIndex.build(torch.tensor([2, -1, 0, 2, -1, 1, 0], dtype=torch.int32), 4)
    assert index.token_order.tolist() == [1, 4, 2, 6, 5, 0, 3]
    assert index.slot_starts.tolist()[:3] == [2, 4, 5]
    assert index.slot_lengths.tolist() == [2, 1, 2, 0]
    assert index.host_segments == ((0, 2, 2), (1, 4, 1), (2, 5, 2))
    assert index.has_adapter and index.max_segment_length == 2
    assert all(t.dtype == torch.int32 for t in (index.token_slots, index.token_order, index.slot_starts))


def test_index_without_adapter_tokens():
    index = LoRAIndex.build(torch.full((5,), -1, dtype=torch.int32), 2)
    assert not index.has_adapter and index.max_segment_length == 0 and index.host_segments == ()
    assert index.slot_lengths.tolist() == [0, 0]


@pytest.mark.parametrize("bad", [[-2, 0], [0, 3]])
def test_index_rejects_slots_out_of_range(bad):
    with pytest.raises(ValueError, match=r"slots must lie in \[-1, 3\)"):
        LoRAIndex.build(torch.tensor(bad, dtype=torch.int32), 3)


def test_static_index_is_refilled_in_place():
    static = LoRAIndex.static(6, 3, "cpu")
    tensors = [static.token_slots, static.token_order, static.slot_starts, static.slot_lengths]
    step = LoRAIndex.build(torch.tensor([1, -1, 1, 0, 2, -1], dtype=torch.int32), 3)
    static.copy_from(step)
    assert [t.data_ptr() for t in tensors] == [
        t.data_ptr() for t in (static.token_slots, static.token_order, static.slot_starts, static.slot_lengths)
    ]
    assert static.token_order.tolist() == step.token_order.tolist()
    assert static.slot_lengths.tolist() == [1, 2, 1] and static.max_segment_length == 6
    with pytest.raises(ValueError, match="T=5"):
        static.copy_from(LoRAIndex.build(torch.zeros(5, dtype=torch.int32), 3))


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_shrink_and_expand_match_a_per_token_loop(name, dtype, impl):
    case = make_case(name, dtype)
    kernels = bind("cpu") if impl == "cpu" else lora
    index = LoRAIndex.build(case.slots, case.num_slots)
    buf = kernels.lora_shrink(case.x, case.lora_a, index)
    assert buf.dtype == torch.float32 and buf.shape == (len(case.out_sizes), len(case.slots), case.lora_a.shape[2])
    torch.testing.assert_close(buf.double(), loop_shrink(case), atol=1e-5, rtol=1e-5)
    y = case.y.clone()
    kernels.lora_expand(y, buf, case.lora_b, index, case.out_sizes)
    assert y.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y.double(), loop_expand(case, buf), atol=atol, rtol=rtol)
    base = case.slots < 0
    assert torch.equal(y[base], case.y[base])  # base-model rows are untouched, bit for bit


def test_padded_segments_layout():
    """The CPU path's batched layout: slots 0 and 1 (2 and 3 tokens), slot 0's row padded with its first token."""
    index = LoRAIndex.build(torch.tensor([1, 0, -1, 1, 0, 1, -1], dtype=torch.int32), 3)
    grid = index.padded_segments
    assert grid.slots.tolist() == [0, 1] and grid.rows.tolist() == [[1, 4, 1], [0, 3, 5]]
    assert grid.real.tolist() == [0, 1, 3, 4, 5] and grid.tokens.tolist() == [1, 4, 0, 3, 5]
    assert grid.waste == pytest.approx(1 / 5) and grid.waste <= lora.MAX_PADDING_WASTE  # so the case runs batched


def test_cpu_backend_binds_the_grouped_path():
    kernels = bind("cpu")
    assert kernels.lora_shrink is lora.grouped_lora_shrink and kernels.lora_expand is lora.grouped_lora_expand


def test_expand_rejects_out_sizes_that_do_not_fill_y():
    case = make_case("mixed_qkv_gqa", torch.float32)
    index = LoRAIndex.build(case.slots, case.num_slots)
    buf = lora.lora_shrink(case.x, case.lora_a, index)
    with pytest.raises(ValueError, match=r"y must be \[T, 40\]"):
        lora.grouped_lora_expand(case.y, buf, case.lora_b, index, (24, 8, 8))
