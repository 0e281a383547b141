"""pagedq.kernels.cpu_native (the C decode kernel reading the paged blocks in place) against kernels.reference, its
build and cache, and kernels.cpu_attention's choice between it and the index_select + SDPA fallback."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from paged_cases import assert_close, make_paged_kv

from pagedq import kernels
from pagedq.engine.layers.attention import paged_attention
from pagedq.engine.layers.metadata import AttentionMetadata
from pagedq.kernels import cpu_attention, cpu_native, reference

NUM_KV_HEADS = 3
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    monkeypatch.delenv("PAGEDQ_CPU_NATIVE", raising=False)
    assert cpu_native.available(), cpu_native.failure()  # this machine has a compiler: the kernel must build


def _inputs(lens, group, head_dim, dtype, block_size=16, seed=0):
    torch.manual_seed(seed)
    k_cache, v_cache, tables, context_lens = make_paged_kv(lens, NUM_KV_HEADS, head_dim, block_size, dtype, "cpu")
    query = torch.randn(len(lens), NUM_KV_HEADS * group, head_dim).to(dtype)
    return query, k_cache, v_cache, tables, context_lens, head_dim**-0.5


def _spread_lens(seed: int, count: int = 6, max_len: int = 600) -> list[int]:
    """Block edges (1, 15, 16, 17) plus random contexts up to max_len."""
    generator = torch.Generator().manual_seed(seed)
    return [1, 15, 16, 17, *torch.randint(2, max_len + 1, (count,), generator=generator).tolist()]


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (4, 64), (3, 32), (4, 128), (2, 44), (1, 96)])
def test_native_decode_matches_reference(dtype, group, head_dim, num_threads):
    """GQA 1/3/4 (3: SmolLM2's 9 query heads on 3 KV heads), the head dims with a fast path (64, 128) and without
    (32; 44 and 96 reach every vector and scalar tail of the loops over D), contexts at block edges and spread to
    600, tables shuffled over the pool and wider than each row needs (the extra entries point at random blocks)."""
    args = _inputs(_spread_lens(group * head_dim), group, head_dim, dtype)
    out = cpu_native.paged_decode_attention(*args, num_threads=num_threads)
    assert_close(out, reference.paged_decode_attention(*args))


@pytest.mark.parametrize("block_size", [8, 32])
def test_native_decode_other_block_sizes(block_size):
    """Tiles of 16 tokens never cross a block: smaller blocks end a tile early, larger ones take two."""
    args = _inputs([1, 7, 8, 9, 31, 32, 33, 95, 250], 3, 64, torch.float32, block_size)
    assert_close(cpu_native.paged_decode_attention(*args), reference.paged_decode_attention(*args))


def test_native_decode_threads_give_the_same_bits():
    """Each (sequence, KV head) task is one thread's: the thread count must not change a single bit."""
    args = _inputs(_spread_lens(5, count=20), 3, 64, torch.float32)
    one = cpu_native.paged_decode_attention(*args, num_threads=1)
    assert torch.equal(one, cpu_native.paged_decode_attention(*args, num_threads=2))


@pytest.mark.parametrize("num_seqs", [0, 1])
def test_native_decode_zero_and_one_rows(num_seqs):
    query, k_cache, v_cache, tables, lens, scale = _inputs([40], 3, 64, torch.float32)
    args = (query[:num_seqs], k_cache, v_cache, tables[:num_seqs], lens[:num_seqs], scale)
    out = cpu_native.paged_decode_attention(*args)
    assert out.shape == (num_seqs, 3 * NUM_KV_HEADS, 64)
    assert_close(out, reference.paged_decode_attention(*args))


def test_native_decode_reads_only_up_to_each_context_len():
    """Cache slots past a row's context (inside its last block) and table entries past its last block, even ones
    outside the pool, never reach the output."""
    query, k_cache, v_cache, tables, lens, scale = _inputs([5, 17, 40], 3, 64, torch.float32)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    k_cache[tables[0, 0], 5:] = 1e3
    v_cache[tables[0, 0], 5:] = float("nan")
    wide = torch.cat([tables, torch.tensor([[-1, 10**6]] * 3, dtype=torch.int32)], dim=1)
    wide[0, 1:] = -1  # row 0 needs one block
    assert_close(cpu_native.paged_decode_attention(query, k_cache, v_cache, wide, lens, scale), expected)


def test_native_decode_rejects_a_block_outside_the_pool():
    query, k_cache, v_cache, tables, lens, scale = _inputs([5, 40], 3, 64, torch.float32)
    tables[1, 2] = k_cache.shape[0]  # row 1's third block, within its 40 tokens
    with pytest.raises(IndexError):
        cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)


def test_native_decode_takes_a_strided_query():
    """The engine's query is a view of the packed qkv projection: rows are strided, heads contiguous."""
    _, k_cache, v_cache, tables, lens, scale = _inputs(_spread_lens(7), 3, 64, torch.bfloat16)
    packed = torch.randn(len(lens), (9 + 2 * NUM_KV_HEADS) * 64).to(torch.bfloat16)
    strided = packed[:, : 9 * 64].view(len(lens), 9, 64)
    assert not strided.is_contiguous()
    out = cpu_native.paged_decode_attention(strided, k_cache, v_cache, tables, lens, scale)
    assert_close(out, reference.paged_decode_attention(strided, k_cache, v_cache, tables, lens, scale))


def test_native_bf16_output_rounds_to_nearest_even_and_nan_propagates():
    """A zero query weighs two tokens 1/2 each: the fp32 mean of 1 + 2^-7 and 1 + 2^-6 lies halfway between two
    bf16 values, and rounds to the even one (1 + 2^-6), as torch rounds (truncation would give 1 + 2^-7). A NaN
    in a value row within the context makes that head's output NaN, as in the reference."""
    k_cache = torch.randn(2, 16, 1, 64).to(torch.bfloat16)
    v_cache = torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16)
    v_cache[0, 0], v_cache[0, 1] = 1 + 2**-7, 1 + 2**-6
    v_cache[1, 0, 0, 3] = float("nan")
    tables, lens = torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32)
    query = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    out = cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(out[0], torch.full((2, 64), 1 + 2**-6, dtype=torch.bfloat16))
    assert torch.equal(out.isnan(), expected.isnan()) and out[1, :, 3].isnan().all()
    assert torch.equal(out[1].nan_to_num(), expected[1].nan_to_num())


def test_decode_path_runs_native_when_available(monkeypatch):
    """cpu_attention (the CPU backend's decode) and the engine's layer path both call the native kernel, and
    the step is planned once for all layers."""
    calls: list[int] = []
    native = cpu_native.run_decode
    monkeypatch.setattr(cpu_native, "run_decode", lambda *args, **kwargs: calls.append(1) or native(*args, **kwargs))
    query, k_cache, v_cache, tables, lens, scale = _inputs(_spread_lens(3), 3, 64, torch.float32)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    assert_close(cpu_attention.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale), expected)
    assert calls == [1]
    meta = AttentionMetadata(
        torch.zeros(0), len(lens), tables, lens, tables[:0], torch.zeros(1, dtype=torch.int32), lens[:0]
    )
    for _ in range(2):  # two layers, one plan
        assert_close(paged_attention(kernels.bind("cpu"), query, k_cache, v_cache, meta, scale), expected)
    assert calls == [1, 1, 1] and meta.derive("cpu_decode_plan", lambda: None).tables is not None


@pytest.mark.parametrize("how", ["env", "unavailable", "fp16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fallback_is_index_select_and_sdpa(monkeypatch, how, dtype):
    """PAGEDQ_CPU_NATIVE=0, a kernel that failed to build, or a cache it does not take (fp16) keep the
    index_select + SDPA path, exact against the reference, with its length groups."""
    if how == "env":
        monkeypatch.setenv("PAGEDQ_CPU_NATIVE", "0")
    elif how == "unavailable":
        monkeypatch.setattr(cpu_native, "available", lambda: False)
    else:
        dtype = torch.float16
    monkeypatch.setattr(cpu_native, "run_decode", lambda *args, **kwargs: pytest.fail("the native kernel ran"))
    query, k_cache, v_cache, tables, lens, scale = _inputs(torch.randint(1, 300, (24,)).tolist(), 3, 64, dtype)
    assert not cpu_attention.use_native(k_cache)
    plan = cpu_attention.plan_decode(tables, lens, 16, cpu_attention.use_native(k_cache))
    assert plan.tables is None and len(plan.groups) > 1
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    assert_close(cpu_attention.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale), expected)


def test_native_plan_over_tensors_the_kernel_does_not_take_falls_back():
    """A native plan handed an fp16 cache (the kernel takes fp32 and bf16) is planned again for SDPA."""
    query, k_cache, v_cache, tables, lens, scale = _inputs(_spread_lens(9), 3, 64, torch.float16)
    plan = cpu_attention.plan_decode(tables, lens, 16, native=True)
    out = cpu_attention.planned_decode(query, k_cache, v_cache, plan, scale)
    assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale))


def test_one_openmp_runtime_is_mapped():
    """The kernel's libgomp.so.1 must be the copy torch loaded: two runtimes would mean two thread pools."""
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def test_build_is_cached_and_safe_to_race(tmp_path):
    """Two builds at once into an empty cache both get the same whole file, and no temporary is left; a later
    build finds it and does not compile again."""
    paths: list = []
    workers = [threading.Thread(target=lambda: paths.append(cpu_native.build(tmp_path))) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(paths) == 2 and paths[0] == paths[1] and paths[0].parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]
    mtime = paths[0].stat().st_mtime_ns
    assert cpu_native.build(tmp_path) == paths[0] and paths[0].stat().st_mtime_ns == mtime


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDQ_NATIVE_CACHE", str(tmp_path / "native"))
    assert cpu_native.cache_dir() == tmp_path / "native"
    monkeypatch.delenv("PAGEDQ_NATIVE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu_native.cache_dir() == tmp_path / "pagedq"


def test_no_compiler_means_unavailable_logged_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_native, "_library", None)
    monkeypatch.setattr(cpu_native, "_failure", None)
    monkeypatch.setenv("PAGEDQ_NATIVE_CACHE", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert not cpu_native.available() and not cpu_native.available()
    assert "no C compiler" in (cpu_native.failure() or "")
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1


def _chunk_inputs(chunks, group, head_dim, dtype, block_size=16):
    """A prefill step of (cached prefix, q_len) chunks: query, caches, tables, cu_seqlens_q, context_lens."""
    context_lens = [prefix + q_len for prefix, q_len in chunks]
    k_cache, v_cache, tables, lens = make_paged_kv(context_lens, NUM_KV_HEADS, head_dim, block_size, dtype, "cpu")
    q_lens = torch.tensor([q_len for _, q_len in chunks])
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32)
    query = torch.randn(int(q_lens.sum()), NUM_KV_HEADS * group, head_dim).to(dtype)
    return query, k_cache, v_cache, tables, cu_seqlens, lens, head_dim**-0.5


VERIFY_CHUNKS = [(14, 2), (3, 5), (300, 5), (58, 6), (7, 3), (280, 17), (1, 1), (150, 2), (0, 17), (0, 1), (16, 16)]


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,head_dim", [(3, 64), (1, 32), (4, 128)])
def test_native_short_chunks_match_reference(dtype, group, head_dim, num_threads):
    """Verify rows (1..17 queries after a cached prefix, ending mid-block and on block edges) and short fresh
    prompts, each query seeing the keys up to its own position; rows of out outside the chunks are left alone."""
    torch.manual_seed(11)
    query, k_cache, v_cache, tables, cu_seqlens, lens, scale = _chunk_inputs(VERIFY_CHUNKS, group, head_dim, dtype)
    starts, lens_list = cu_seqlens.tolist(), lens.tolist()
    chunks = cpu_native.short_chunks(tables, starts, lens_list, [s for s in range(len(VERIFY_CHUNKS)) if s != 4])
    out = torch.full_like(query, 7.0)
    cpu_native.run_chunks(query, k_cache, v_cache, chunks, scale, out, num_threads=num_threads)
    expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu_seqlens, lens, scale)
    skipped = slice(starts[4], starts[5])
    assert (out[skipped] == 7.0).all()
    out[skipped] = expected[skipped]
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_plan_sends_short_chunks_to_native(monkeypatch, dtype):
    """cpu_attention's prefill: long chunks by SDPA, short ones by the native kernel (no short groups built, none
    of their blocks gathered); over an fp16 cache, which the kernel does not take, the short groups; a native plan
    handed a query the kernel does not take plans again for SDPA."""
    torch.manual_seed(12)
    calls: list[int] = []
    native = cpu_native.run_chunks
    monkeypatch.setattr(cpu_native, "run_chunks", lambda *args, **kwargs: calls.append(1) or native(*args, **kwargs))
    chunks = [*VERIFY_CHUNKS, (0, 40), (35, 25)]  # and two longer than the batched bound
    for cache_dtype, runs in ((dtype, [1]), (torch.float16, [1])):
        query, k_cache, v_cache, tables, cu_seqlens, lens, scale = _chunk_inputs(chunks, 3, 64, cache_dtype)
        plan = cpu_attention.plan_prefill(tables, cu_seqlens, lens, 16, 3, cpu_attention.use_native(k_cache))
        native_plan = cache_dtype != torch.float16
        assert (plan.native_short is not None) == native_plan and bool(plan.short_groups) != native_plan
        long_blocks = sum(-(-chunk.context_len // 16) for chunk in plan.chunks)
        assert (len(plan.blocks) == long_blocks) == native_plan  # the short chunks' blocks are read in place
        out = cpu_attention.planned_prefill(query, k_cache, v_cache, plan, scale)
        assert calls == runs
        expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu_seqlens, lens, scale)
        assert_close(out, expected)
    forced = cpu_attention.plan_prefill(tables, cu_seqlens, lens, 16, 3, native=True)  # fp16 under a native plan
    assert_close(cpu_attention.planned_prefill(query, k_cache, v_cache, forced, scale), expected)
    assert calls == [1]
