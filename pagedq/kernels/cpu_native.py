"""The native CPU kernels (cpu_native.c beside this file), built on first use: the paged attention that reads the
KV blocks in place, and the batched LoRA add (kernels.cpu_lora's decode-sized calls).

Why: the index_select + SDPA path (kernels.cpu_attention) copies every block a step reads once more before SDPA
reads it, which made it ~3x slower than SDPA over contiguous K/V of the same shape; this kernel reads each K/V
row once, where it lies (docs/kernels.md has the figures).

The C file includes no torch headers, so building it takes a couple of seconds with the system compiler (`CC`,
else `cc`, else `gcc`). The .so lands in a cache directory (PAGEDQ_NATIVE_CACHE, else $XDG_CACHE_HOME/pagedq,
else ~/.cache/pagedq) under a name hashed from the source, the flags, the compiler's version and the machine
(-march=native code must not run on another CPU). It is compiled under a temporary name and moved into place with
os.replace, so processes building at once (test workers, two engines) each see a whole file.

OpenMP: it links with -fopenmp, so it needs `libgomp.so.1`; torch's wheel ships and has already loaded its own
libgomp.so.1, and the loader resolves the soname to that copy: one OpenMP runtime, one thread pool, one
OMP_WAIT_POLICY (tests/kernels/test_cpu_native.py checks that only one libgomp is mapped).

`available()` is False, with the reason logged once, when PAGEDQ_CPU_NATIVE=0, there is no compiler, or the
build or the load fails; kernels.cpu_attention then keeps its index_select + SDPA path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.c")
# No -ffast-math: it would let the compiler assume no NaN/inf (the reference propagates them) and reorder the
# reductions; the kernel's loops are written so -O3 vectorises them without it.
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-fopenmp", "-fPIC", "-shared")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


def cache_dir() -> Path:
    if os.environ.get("PAGEDQ_NATIVE_CACHE"):
        return Path(os.environ["PAGEDQ_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedq"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _machine() -> str:
    """What -march=native depends on: the architecture and, on Linux, the CPU's model and feature flags."""
    parts = [platform.machine(), platform.system()]
    try:
        with open("/proc/cpuinfo") as info:
            parts += sorted({line for line in info if line.startswith(("model name", "flags", "Features"))})
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def build(directory: Path | None = None) -> Path:
    """Path of the compiled kernel, compiling it first unless the cache holds it. Raises RuntimeError on failure."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (set CC, or install cc/gcc)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _machine().encode()]))
    directory = directory or cache_dir()
    target = directory / f"cpu_native-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        command = [compiler, *FLAGS, "-o", temporary, str(SOURCE), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
        os.replace(temporary, target)  # atomic: a concurrent build either wins or is overwritten by an equal file
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


def _load() -> ctypes.CDLL:
    library = ctypes.CDLL(str(build()))
    fn = library.pagedq_paged_attention
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, i32, i32, i32, i32, i32, ptr, i32, ptr, ptr, ptr, ctypes.c_float]
    fn.argtypes += [ptr, i64, i64, i32, i32, i32, ctypes.c_float, ptr]
    fn.restype = i32
    fn = library.pagedq_lora_add
    fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i32, i32, i32, i32, i32, ptr, ptr, ptr, ptr, i32, i32]
    fn.restype = i32
    return library


def available() -> bool:
    """Whether the native kernel can run here (built and loaded on the first call). PAGEDQ_CPU_NATIVE=0 turns it
    off; it is read on every call (cheap), so tests and operators can switch at run time."""
    global _library, _failure
    if os.environ.get("PAGEDQ_CPU_NATIVE", "").strip() == "0":
        return False
    if _library is not None:
        return True
    if _failure is not None:
        return False
    with _lock:
        if _library is None and _failure is None:
            try:
                _library = _load()
            except (OSError, RuntimeError) as error:
                _failure = str(error)
                logger.warning("native CPU attention unavailable, using index_select + SDPA: %s", _failure)
    return _library is not None


def failure() -> str | None:
    """Why the last attempt to build or load the kernel failed (None if it did not fail)."""
    return _failure


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether these tensors suit the kernel: CPU, fp32 or bf16 throughout, contiguous caches, a query whose
    last dim is contiguous, Hq a multiple of Hkv (shape checks only: call available() for the kernel itself)."""
    dtype = query.dtype
    if dtype not in (torch.float32, torch.bfloat16) or k_cache.dtype != dtype or v_cache.dtype != dtype:
        return False
    if query.device.type != "cpu" or k_cache.device.type != "cpu" or v_cache.device.type != "cpu":
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape:
        return False
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    return (
        query.dim() == 3 and query.shape[2] == head_dim and query.shape[1] % num_kv_heads == 0 and query.stride(2) == 1
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """pagedq.kernels.reference.paged_decode_attention, read in place: query [S, Hq, D]; block_tables [S, M] int32;
    context_lens [S] int32 -> [S, Hq, D] in the query's dtype; window, softcap and sinks as the reference's. Raises
    RuntimeError if the kernel is unavailable, ValueError for tensors it does not take (supports), IndexError for a
    block index out of the pool."""
    if not available():
        raise RuntimeError(f"native CPU attention unavailable: {_failure or 'PAGEDQ_CPU_NATIVE=0'}")
    if not supports(query, k_cache, v_cache):
        raise ValueError("unsupported tensors for native CPU attention (see cpu_native.supports)")
    tables, lens = block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()
    return run_decode(
        query, k_cache, v_cache, tables, lens, scale, num_threads, window=window, softcap=softcap, sinks=sinks
    )


def run_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_decode_attention without its checks, for a caller that made them once (kernels.cpu_attention's plan):
    available() and supports() hold, tables [S, M] and lens [S] are contiguous int32 CPU tensors.
    num_threads defaults to torch.get_num_threads(), as torch's own ops would use in this thread."""
    assert _library is not None, "call available() first"
    num_seqs, num_q_heads, head_dim = query.shape
    if tables.dim() != 2 or tables.shape[0] != num_seqs or lens.shape != (num_seqs,):
        raise ValueError(f"block_tables {tuple(tables.shape)} / context_lens {tuple(lens.shape)} for {num_seqs} rows")
    out = torch.empty(num_seqs, num_q_heads, head_dim, dtype=query.dtype)
    _call(query, k_cache, v_cache, tables, lens, None, scale, out, num_threads, Variant(window, softcap, sinks))
    return out


@dataclass(frozen=True)
class Variant:
    """The attention variant a call runs (pagedq/kernels/reference.py defines them): window 0 and softcap 0 are
    none, sinks None is none."""

    window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    def checked_sinks(self, num_q_heads: int) -> torch.Tensor | None:
        """The sinks as the kernel reads them, [num_q_heads] contiguous fp32 on the CPU (ValueError otherwise)."""
        if self.window < 0 or not self.softcap >= 0:
            raise ValueError(f"window must be >= 0 and softcap >= 0, got {self.window} and {self.softcap}")
        if self.sinks is None:
            return None
        if self.sinks.shape != (num_q_heads,) or self.sinks.device.type != "cpu":
            raise ValueError(f"sinks must be a [{num_q_heads}] CPU tensor, got {tuple(self.sinks.shape)}")
        return self.sinks.float().contiguous()


@dataclass(frozen=True)
class Chunks:
    """Short query chunks for run_chunks, [N] / [N, M] contiguous int32, the longest context first (the dynamic
    schedule then ends on short tasks): chunk s is query rows q_starts[s] + [0, q_lens[s]), query i at position
    lens[s] - q_lens[s] + i over the blocks tables[s], seeing the keys up to its own."""

    q_starts: torch.Tensor
    q_lens: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor


def short_chunks(block_tables: torch.Tensor, starts: list[int], lens: list[int], seqs: list[int]) -> Chunks:
    """The Chunks of sequences `seqs` of a prefill step: block_tables [P, M], cu_seqlens_q `starts` [P + 1] and
    context_lens `lens` [P] as lists (prefill's plan has them so)."""
    order = sorted(seqs, key=lambda seq: -lens[seq])
    q_starts = torch.tensor([starts[seq] for seq in order], dtype=torch.int32)
    q_lens = torch.tensor([starts[seq + 1] - starts[seq] for seq in order], dtype=torch.int32)
    tables = block_tables[torch.tensor(order, dtype=torch.long)].to(torch.int32).contiguous()
    return Chunks(q_starts, q_lens, tables, torch.tensor([lens[seq] for seq in order], dtype=torch.int32))


def run_chunks(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunks: Chunks,
    scale: float,
    out: torch.Tensor,
    num_threads: int | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal attention of short query chunks (Chunks) into their rows of `out` (the query's shape and dtype, head
    dim contiguous; other rows are left as they are), with available() and supports() checked by the caller."""
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError("out must have the query's shape and dtype, its head dim contiguous")
    ends = chunks.q_starts.long() + chunks.q_lens.long()
    if len(ends) and (int(ends.max()) > query.shape[0] or int(chunks.q_starts.min()) < 0):
        raise ValueError(f"chunk rows outside the query's {query.shape[0]} rows")
    limits = (chunks.q_starts, chunks.q_lens)
    variant = Variant(window, softcap, sinks)
    _call(query, k_cache, v_cache, chunks.tables, chunks.lens, limits, scale, out, num_threads, variant)


def _call(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    chunks: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float,
    out: torch.Tensor,
    num_threads: int | None,
    variant: Variant,
) -> None:
    assert _library is not None, "call available() first"
    if lens.shape[0] == 0:
        return
    sinks = variant.checked_sinks(query.shape[1])
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    starts, q_lens = (None, None) if chunks is None else (chunks[0].data_ptr(), chunks[1].data_ptr())
    status = _library.pagedq_paged_attention(
        query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        num_blocks, block_size, num_kv_heads, head_dim, lens.shape[0], query.shape[1], tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), starts, q_lens, scale, out.data_ptr(), out.stride(0), out.stride(1),
        query.dtype == torch.bfloat16, num_threads or torch.get_num_threads(),
        variant.window, variant.softcap, None if sinks is None else sinks.data_ptr(),
    )  # fmt: skip
    if status == 1:
        raise IndexError(f"a block table entry within a context is outside the pool of {num_blocks} blocks")
    if status == 3:
        raise MemoryError("native CPU attention could not allocate a task's state")
    if status:
        raise ValueError(f"native CPU attention rejected the shapes (status {status})")


LORA_MAX_RANK = 1024  # cpu_native.c's bound on R (its per-task shrink buffer lives on the stack)


def lora_supports(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """Whether these tensors suit the native LoRA add: CPU, fp32 or bf16 throughout, x's and y's rows contiguous,
    the stacked weights contiguous, R <= LORA_MAX_RANK (shape checks only: call available() for the kernel)."""
    tensors = (y, x, lora_a, lora_b)
    if x.dtype not in (torch.float32, torch.bfloat16) or any(t.dtype != x.dtype for t in tensors):
        return False
    if any(t.device.type != "cpu" for t in tensors) or not (lora_a.is_contiguous() and lora_b.is_contiguous()):
        return False
    return y.dim() == 2 and x.dim() == 2 and y.stride(1) == 1 and x.stride(1) == 1 and lora_a.shape[2] <= LORA_MAX_RANK


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_order: torch.Tensor,
    slot_starts: torch.Tensor,
    slot_lengths: torch.Tensor,
    out_sizes: tuple[int, ...],
    num_threads: int | None = None,
) -> None:
    """kernels.lora.lora_add in one native call, y updated in place: x [T, in], y [T, sum(out_sizes)], lora_a
    [S, N, R, in], lora_b [S, N, max_out, R], and a LoRAIndex's token_order [T], slot_starts [S] and slot_lengths
    [S] (contiguous int32; slot s's tokens are token_order[start : start + length]). The caller checked the
    shapes (kernels.lora.check_lora_add_shapes), available() and lora_supports()."""
    assert _library is not None, "call available() first"
    index = (token_order, slot_starts, slot_lengths)
    if any(t.dtype != torch.int32 or not t.is_contiguous() for t in index):
        raise ValueError("token_order, slot_starts and slot_lengths must be contiguous int32")
    num_slots, num_slices, rank, in_dim = lora_a.shape
    sizes = (ctypes.c_int * len(out_sizes))(*out_sizes)
    status = _library.pagedq_lora_add(
        y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), lora_a.data_ptr(), lora_b.data_ptr(),
        num_slots, num_slices, rank, in_dim, lora_b.shape[2], sizes, token_order.data_ptr(),
        slot_starts.data_ptr(), slot_lengths.data_ptr(), x.dtype == torch.bfloat16,
        num_threads or torch.get_num_threads(),
    )  # fmt: skip
    if status == 3:
        raise MemoryError("native LoRA add could not allocate a task's buffers")
    if status:
        raise ValueError(f"native LoRA add rejected the shapes (status {status})")
