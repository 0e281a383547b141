"""LoRAIndex, the torch reference and the CPU (slot-grouped) path of the batched LoRA kernels."""

from __future__ import annotations

import pytest
import torch
from lora_cases import CASES, TOLERANCES, loop_expand, loop_shrink, make_case

from pagedq.kernels import bind, cpu_lora, cpu_native, lora
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_shrink_and_expand_match_a_per_token_loop(name, dtype):
    case = make_case(name, dtype)
    index = LoRAIndex.build(case.slots, case.num_slots)
    buf = lora.lora_shrink(case.x, case.lora_a, index)
    assert buf.dtype == torch.float32 and buf.shape == (len(case.out_sizes), len(case.slots), case.lora_a.shape[2])
    torch.testing.assert_close(buf.double(), loop_shrink(case), atol=1e-5, rtol=1e-5)
    y = case.y.clone()
    lora.lora_expand(y, buf, case.lora_b, index, case.out_sizes)
    assert y.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y.double(), loop_expand(case, buf), atol=atol, rtol=rtol)
    base = case.slots < 0
    assert torch.equal(y[base], case.y[base])  # base-model rows are untouched, bit for bit


@pytest.mark.parametrize("impl", ["reference", "native", "cpu", "cpu_large"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_lora_add_matches_a_per_token_loop(name, dtype, impl, monkeypatch):
    """lora_add, the layer's call, against shrink-then-expand by the loop: the reference; the CPU path by its native
    kernel (fp32 and bf16; fp16 falls back to the torch ops); and the CPU path's torch ops (PAGEDQ_CPU_NATIVE=0) in
    both of their layouts (the decode cases batch the slots, the unequal ones loop over them) and both ways back (a
    decode-sized call gathers its result back; "cpu_large" lowers the size bound so every call adds in place)."""
    native_calls = _count_native_calls(monkeypatch)
    if impl == "native":
        monkeypatch.delenv("PAGEDQ_CPU_NATIVE", raising=False)
        assert cpu_native.available(), cpu_native.failure()  # this machine has a compiler: the kernel must build
    else:
        monkeypatch.setenv("PAGEDQ_CPU_NATIVE", "0")
    if impl == "cpu_large":
        monkeypatch.setattr(cpu_lora, "SMALL_CALL_ELEMENTS", 0)
    case = make_case(name, dtype)
    index = LoRAIndex.build(case.slots, case.num_slots)
    y = case.y.clone()
    (lora if impl == "reference" else bind("cpu")).lora_add(y, case.x, case.lora_a, case.lora_b, index, case.out_sizes)
    assert y.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y.double(), loop_expand(case, loop_shrink(case)), atol=atol, rtol=rtol)
    base = case.slots < 0
    assert torch.equal(y[base], case.y[base])  # base-model rows are untouched, bit for bit
    takes_native = impl == "native" and dtype != torch.float16 and index.has_adapter
    assert native_calls == ([1] if takes_native else [])


def _count_native_calls(monkeypatch) -> list[int]:
    """Calls of the native LoRA kernel from here on, one entry each."""
    calls: list[int] = []
    kernel = cpu_native.lora_add
    monkeypatch.setattr(cpu_native, "lora_add", lambda *args, **kwargs: (calls.append(1), kernel(*args, **kwargs))[1])
    return calls


# Shapes the test cases above keep regular: a rank that is not a multiple of 8 (the expand's one-output loop), odd
# widths (the dot products' tails), slots of more than 8 tokens (two token groups), a slot whose weights are padded
# past its tokens' rank, and slots that are not consecutive.
NATIVE_SHAPES = {
    "rank_12_odd_widths": (12, 37, (20, 5, 13), [0, 1, -1, 1, 0, 3] * 3),
    "rank_16_long_slot": (16, 64, (40, 24), [2] * 19 + [-1, 0]),
    "rank_8_one_output": (8, 9, (1,), [1, -1, 1]),
    "rank_24_wide": (24, 200, (72,), list(range(4)) * 5),
}


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(NATIVE_SHAPES))
def test_native_lora_add_irregular_shapes(name, dtype, num_threads, monkeypatch):
    """The native kernel, called directly (past the dispatch's tokens-per-slot bound), against the reference; each
    output element is one task's, so the thread count does not change a bit."""
    monkeypatch.delenv("PAGEDQ_CPU_NATIVE", raising=False)
    assert cpu_native.available(), cpu_native.failure()
    rank, in_dim, out_sizes, slot_list = NATIVE_SHAPES[name]
    gen = torch.Generator().manual_seed(rank * in_dim)
    num_slots, num_slices = 4, len(out_sizes)
    lora_a = (torch.randn(num_slots, num_slices, rank, in_dim, generator=gen) / in_dim**0.5).to(dtype)
    lora_b = (torch.randn(num_slots, num_slices, max(out_sizes) + 3, rank, generator=gen) / rank**0.5).to(dtype)
    x = torch.randn(len(slot_list), in_dim + 5, generator=gen).to(dtype)[:, 2 : 2 + in_dim]  # strided rows
    y = torch.randn(len(slot_list), sum(out_sizes), generator=gen).to(dtype)
    index = LoRAIndex.build(torch.tensor(slot_list, dtype=torch.int32), num_slots)
    expected = y.clone()
    lora.lora_add(expected, x, lora_a, lora_b, index, out_sizes)
    out = y.clone()
    cpu_native.lora_add(out, x, lora_a, lora_b, index.token_order, index.slot_starts, index.slot_lengths, out_sizes,
                        num_threads)  # fmt: skip
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected.double(), atol=atol, rtol=rtol)
    base = index.token_slots < 0
    assert torch.equal(out[base], y[base])
    again = y.clone()
    cpu_native.lora_add(again, x, lora_a, lora_b, index.token_order, index.slot_starts, index.slot_lengths, out_sizes,
                        3 - num_threads)  # fmt: skip
    assert torch.equal(again, out)


def test_native_lora_add_takes_few_tokens_per_slot(monkeypatch):
    """The dispatch: slots of at most NATIVE_MAX_SLOT_TOKENS tokens run natively, a longer one by the torch ops;
    PAGEDQ_CPU_NATIVE=0 and tensors the kernel does not take (fp16, a transposed weight stack) keep the torch ops."""
    monkeypatch.delenv("PAGEDQ_CPU_NATIVE", raising=False)
    calls = _count_native_calls(monkeypatch)
    limit = cpu_lora.NATIVE_MAX_SLOT_TOKENS
    case = make_case("one_slot_gate_up", torch.float32)

    def add(num_tokens: int, dtype: torch.dtype = torch.float32, lora_b: torch.Tensor | None = None) -> None:
        x, y = torch.randn(num_tokens, case.x.shape[1], dtype=dtype), torch.randn(num_tokens, 48, dtype=dtype)
        index = LoRAIndex.build(torch.ones(num_tokens, dtype=torch.int32), 2)
        b = (case.lora_b if lora_b is None else lora_b).to(dtype)
        expected = y.clone()
        lora.lora_add(expected, x, case.lora_a.to(dtype), b, index, (24, 24))
        cpu_lora.grouped_lora_add(y, x, case.lora_a.to(dtype), b, index, (24, 24))
        torch.testing.assert_close(y.double(), expected.double(), atol=2e-3, rtol=2e-3)

    add(limit)
    assert calls == [1]
    add(limit + 1)
    add(limit, torch.float16)
    add(limit, lora_b=case.lora_b.transpose(0, 1).contiguous().transpose(0, 1))
    monkeypatch.setenv("PAGEDQ_CPU_NATIVE", "0")
    add(limit)
    assert calls == [1]


def test_slot_rows_batched_layout():
    """Decode-like segments: slots 0 and 1 (2 and 3 tokens) in a [2, 3] grid, slot 0's row padded with its first
    token; base-model tokens read the zero row past the grid."""
    index = LoRAIndex.build(torch.tensor([1, 0, -1, 1, 0, 1, -1], dtype=torch.int32), 3)
    layout = index.slot_rows
    assert layout.grid == (2, 3) and layout.grid_slots.tolist() == [0, 1] and layout.slot_span == (0, 2)
    assert layout.token_of_row.tolist() == [1, 4, 1, 0, 3, 5]
    assert layout.row_of_token.tolist() == [3, 0, 6, 4, 1, 5, 6]
    assert layout.waste == pytest.approx(1 / 5) and layout.waste <= lora.MAX_PADDING_WASTE


def test_slot_rows_per_slot_layout():
    """Unequal segments (padding would exceed MAX_PADDING_WASTE): the segments back to back, one matmul each."""
    index = LoRAIndex.build(torch.tensor([2, -1, 0, 2, 2, 2, 2, 2], dtype=torch.int32), 3)
    layout = index.slot_rows
    assert layout.grid is None and layout.waste > lora.MAX_PADDING_WASTE
    assert layout.segments == ((0, 0, 1), (2, 1, 6))
    assert layout.token_of_row.tolist() == [2, 0, 3, 4, 5, 6, 7]
    assert layout.row_of_token.tolist() == [1, 7, 0, 2, 3, 4, 5, 6]


def test_cpu_backend_binds_the_grouped_path():
    assert bind("cpu").lora_add is cpu_lora.grouped_lora_add


@pytest.mark.parametrize("add", [lora.lora_add, cpu_lora.grouped_lora_add], ids=["reference", "cpu"])
def test_lora_add_rejects_out_sizes_that_do_not_fill_y(add):
    case = make_case("mixed_qkv_gqa", torch.float32)
    index = LoRAIndex.build(case.slots, case.num_slots)
    with pytest.raises(ValueError, match=r"y must be \[T, 40\]"):
        add(case.y, case.x, case.lora_a, case.lora_b, index, (24, 8, 8))


def test_small_calls_run_on_one_thread_and_restore_the_count(monkeypatch):
    """A decode-sized call drops to one intra-op thread and gives the caller's count back, even when it raises; a
    prefill-sized one keeps every thread."""
    monkeypatch.setenv("PAGEDQ_CPU_NATIVE", "0")  # the torch ops' rule
    case = make_case("decode_every_slot", torch.float32)
    index = LoRAIndex.build(case.slots, case.num_slots)
    before, set_threads, counts = torch.get_num_threads(), torch.set_num_threads, []
    set_threads(2)
    try:
        monkeypatch.setattr(torch, "set_num_threads", lambda n: (counts.append(n), set_threads(n))[1])
        cpu_lora.grouped_lora_add(case.y.clone(), case.x, case.lora_a, case.lora_b, index, case.out_sizes)
        assert counts == [1, 2] and torch.get_num_threads() == 2
        with monkeypatch.context() as patch:
            patch.setattr(torch, "bmm", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("bmm failed")))
            with pytest.raises(RuntimeError, match="bmm failed"):
                cpu_lora.grouped_lora_add(case.y.clone(), case.x, case.lora_a, case.lora_b, index, case.out_sizes)
        assert counts == [1, 2, 1, 2] and torch.get_num_threads() == 2
        monkeypatch.setattr(cpu_lora, "SMALL_CALL_ELEMENTS", 0)
        cpu_lora.grouped_lora_add(case.y.clone(), case.x, case.lora_a, case.lora_b, index, case.out_sizes)
        assert counts == [1, 2, 1, 2]
    finally:
        set_threads(before)
