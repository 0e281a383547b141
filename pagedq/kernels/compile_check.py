"""Compile every Triton kernel for a GPU target on a machine without a GPU: `python -m pagedq.kernels.compile_check`.

The interpreter (TRITON_INTERPRET=1) checks the math but not what only the compiler enforces: loop-carried
types, tl.dot shape rules, layouts, shared-memory use. This runs each launcher on `meta` tensors with the
production shapes, captures the arguments it would launch with, and compiles the kernel through Triton's
bundled LLVM and ptxas for sm_90 (H100/H200). Exit status 0 when every kernel compiles and fits.
Must run with TRITON_INTERPRET unset or 0 (the kernels must be JIT functions, not interpreted ones).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import contextmanager

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from pagedq.kernels import (
    activation,
    block_copy,
    decode_attention,
    kv_cache,
    moe,
    norm,
    prefill_attention,
    rotary,
    sampling,
)

SM90_TARGET = GPUTarget("cuda", 90, 32)
SM90_MAX_SHARED_BYTES = 232448  # 227 KiB opt-in shared memory per block on H100/H200
# Per SM on sm_90 (CUDA occupancy rules): 64K 32-bit registers, allocated per warp in units of 256; 228 KiB of
# shared memory, 1 KiB of it reserved per resident block; 2048 threads; 32 blocks.
SM90_REGISTERS_PER_SM = 65536
SM90_SHARED_BYTES_PER_SM = 233472
SM90_RESERVED_SHARED_PER_BLOCK = 1024
_POINTER_TYPES = {
    torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
    torch.int32: "*i32", torch.int64: "*i64",
}  # fmt: skip
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


class _LaunchRecorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` records the call instead of launching."""

    def __init__(self, kernel: JITFunction):
        self.kernel = kernel
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


@contextmanager
def _recording(module, kernel_name: str):
    kernel = getattr(module, kernel_name)
    recorder = _LaunchRecorder(kernel)
    setattr(module, kernel_name, recorder)
    try:
        yield recorder
    finally:
        setattr(module, kernel_name, kernel)


def _scalar_type(value) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def compile_recorded(kernel: JITFunction, args: tuple, kwargs: dict):
    """Compile `kernel` for sm_90 with the arguments a launcher passed it."""
    meta = {k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS}
    for interpreter_fix in ("UPCAST_DOT", "RNE_BY_HAND"):
        if interpreter_fix in meta:
            meta[interpreter_fix] = False  # on meta tensors the launcher saw a recorder, not a JIT kernel
    values = dict(zip(kernel.arg_names, args))
    values.update(meta)
    # Specialise like a real JIT launch: ints equal to 1 become constants, and pointers (torch allocations
    # are 16-byte aligned) and ints divisible by 16 are marked so, which is what enables vectorised loads.
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr or (type(value) is int and value == 1):
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
            continue
        if isinstance(value, torch.Tensor):
            signature[param.name] = _POINTER_TYPES[value.dtype]
        else:
            signature[param.name] = _scalar_type(value)
        if isinstance(value, torch.Tensor) or (type(value) is int and value % 16 == 0):
            attrs[(index,)] = [["tt.divisibility", 16]]
    options = {k: kwargs[k] for k in _LAUNCH_OPTIONS if k in kwargs}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=SM90_TARGET, options=options)


def _find_ptxas() -> str | None:
    """The ptxas Triton itself compiles with (it picks among its bundled ones by architecture)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return None
    for args in ((SM90_TARGET.arch,), ()):  # the signature varies across Triton releases
        try:
            return get_ptxas(*args).path
        except TypeError:
            continue
    return None


def ptxas_usage(ptx: str) -> tuple[int, int] | None:
    """(registers per thread, spill-store bytes) from Triton's bundled ptxas, or None if it is missing."""
    ptxas = _find_ptxas()
    arch = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE)
    if ptxas is None or arch is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-v", f"--gpu-name={arch.group(1)}", source, "-o", os.path.join(tmp, "kernel.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return int(registers.group(1)) if registers else 0, int(spills.group(1)) if spills else 0


def ctas_per_sm(registers: int, shared_bytes: int, num_warps: int) -> int:
    """How many blocks of a kernel fit on one sm_90 SM at once, by registers, shared memory and threads."""
    registers_per_warp = -(-registers * 32 // 256) * 256
    by_registers = (SM90_REGISTERS_PER_SM // max(registers_per_warp, 1)) // num_warps
    by_shared = SM90_SHARED_BYTES_PER_SM // (shared_bytes + SM90_RESERVED_SHARED_PER_BLOCK)
    return min(by_registers, by_shared, 2048 // (32 * num_warps), 32)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _production_calls() -> list[tuple[str, object, list[str], Callable[[], object]]]:
    """(label, module, kernel names, launcher call) with model-sized shapes (Llama-8B-like, GQA 4, D 128)."""
    i32 = torch.int32
    caches = (_meta(4096, 16, 8, 128), _meta(4096, 16, 8, 128))
    fp32_caches = (_meta(512, 16, 8, 128, dtype=torch.float32), _meta(512, 16, 8, 128, dtype=torch.float32))
    tables, lens = _meta(64, 256, dtype=i32), _meta(64, dtype=i32)
    cu = _meta(65, dtype=i32)
    decode = decode_attention.paged_decode_attention
    prefill = prefill_attention.paged_prefill_attention
    return [
        ("store_kv_cache", kv_cache, ["_store_kv_cache_kernel"],
         lambda: kv_cache.store_kv_cache(_meta(64, 8, 128), _meta(64, 8, 128), *caches, _meta(64, dtype=torch.int64))),
        ("decode bf16 gqa4", decode_attention, ["_decode_partition_kernel", "_decode_reduce_kernel"],
         lambda: decode(_meta(64, 32, 128), *caches, tables, lens, 0.088)),
        ("decode bf16 gqa8 d64", decode_attention, ["_decode_partition_kernel", "_decode_reduce_kernel"],
         lambda: decode(_meta(64, 64, 64), _meta(64, 16, 8, 64), _meta(64, 16, 8, 64), tables, lens, 0.125)),
        ("decode fp32", decode_attention, ["_decode_partition_kernel"],
         lambda: decode(_meta(64, 32, 128, dtype=torch.float32), *fp32_caches, tables[:, :8], lens, 0.088)),
        ("prefill bf16 gqa4", prefill_attention, ["_prefill_kernel"],
         lambda: prefill(_meta(4096, 32, 128), *caches, tables, cu, lens, 0.088)),
        ("prefill fp16 gqa4", prefill_attention, ["_prefill_kernel"],
         lambda: prefill(_meta(4096, 32, 128, dtype=torch.float16), _meta(4096, 16, 8, 128, dtype=torch.float16),
                         _meta(4096, 16, 8, 128, dtype=torch.float16), tables, cu, lens, 0.088)),
        ("prefill bf16 gqa1 d64", prefill_attention, ["_prefill_kernel"],
         lambda: prefill(_meta(4096, 8, 64), _meta(64, 16, 8, 64), _meta(64, 16, 8, 64), tables, cu, lens, 0.125)),
        ("prefill fp32 gqa8", prefill_attention, ["_prefill_kernel"],
         lambda: prefill(_meta(4096, 64, 128, dtype=torch.float32), *fp32_caches, tables, cu, lens, 0.088)),
        # attention variants (constexpr switches, so the plain kernels above are unchanged): gpt-oss's sliding
        # window with sinks, Gemma 2's soft-cap with a window, each in both kernels
        ("decode bf16 gqa8 window+sinks", decode_attention, ["_decode_partition_kernel", "_decode_reduce_kernel"],
         lambda: decode(_meta(64, 64, 64), _meta(64, 16, 8, 64), _meta(64, 16, 8, 64), tables, lens, 0.125,
                        window=128, sinks=_meta(64, dtype=torch.float32))),
        ("decode bf16 gqa4 window+softcap", decode_attention, ["_decode_partition_kernel", "_decode_reduce_kernel"],
         lambda: decode(_meta(64, 32, 128), *caches, tables, lens, 0.088, window=4096, softcap=50.0)),
        ("prefill bf16 gqa8 window+sinks", prefill_attention, ["_prefill_kernel"],
         lambda: prefill(_meta(4096, 64, 64), _meta(64, 16, 8, 64), _meta(64, 16, 8, 64), tables, cu, lens, 0.125,
                         window=128, sinks=_meta(64, dtype=torch.float32))),
        ("prefill bf16 gqa4 window+softcap", prefill_attention, ["_prefill_kernel"],
         lambda: prefill(_meta(4096, 32, 128), *caches, tables, cu, lens, 0.088, window=4096, softcap=50.0)),
        ("rms_norm", norm, ["_rms_norm_kernel"],
         lambda: norm.rms_norm(_meta(64, 4096), _meta(4096), 1e-6, _meta(64, 4096))),
        ("head_rms_norm", norm, ["_head_rms_norm_kernel"],
         lambda: norm.head_rms_norm(_meta(64, 32, 128), _meta(128), 1e-6)),
        ("rms_norm unit_offset", norm, ["_rms_norm_kernel"],
         lambda: norm.rms_norm(_meta(64, 3584), _meta(3584), 1e-6, _meta(64, 3584), unit_offset=True)),
        ("head_rms_norm unit_offset", norm, ["_head_rms_norm_kernel"],
         lambda: norm.head_rms_norm(_meta(64, 16, 256), _meta(256), 1e-6, unit_offset=True)),
        ("rotary", rotary, ["_rotary_kernel"],
         lambda: rotary.rotary_embedding(_meta(64, 32, 128), _meta(64, 8, 128), _meta(64, dtype=torch.int64),
                                         _meta(8192, 128, dtype=torch.float32))),
        ("silu_and_mul", activation, ["_silu_and_mul_kernel"],
         lambda: activation.silu_and_mul(_meta(64, 2 * 14336))),
        ("gelu_tanh_and_mul", activation, ["_gelu_tanh_and_mul_kernel"],
         lambda: activation.gelu_tanh_and_mul(_meta(64, 2 * 9216))),
        ("copy_blocks bf16", block_copy, ["_copy_blocks_kernel"],
         lambda: block_copy.copy_blocks([caches[0]] * 32, [caches[1]] * 32, _meta(64, 2, dtype=torch.int64))),
        ("gumbel_argmax 4 splits", sampling, ["_gumbel_argmax_partial_kernel", "_gumbel_argmax_reduce_kernel"],
         lambda: sampling.gumbel_argmax_split(_meta(256, 151936, dtype=torch.float32), _meta(256, dtype=torch.float32),
                                              _meta(256, dtype=torch.int64), _meta(256, dtype=torch.int64), 4)),
        *_moe_calls(),
    ]  # fmt: skip


def _moe_calls() -> list[tuple[str, object, list[str], Callable[[], object]]]:
    """fused_moe at Qwen3-30B-A3B (E 128, K 8, H 2048, I 768), Mixtral-8x7B (E 8, K 2, H 4096, I 14336) and
    gpt-oss-20b (E 32, K 4, H 2880, I 2880, biases, clamped SwiGLU) sizes; decode batches take 16-row tiles,
    prefill chunks 64-row ones."""
    kernels = ["_moe_gate_up_kernel", "_moe_down_kernel"]

    def call(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype=torch.bfloat16, bias=False):
        biases = {"w13_bias": _meta(experts, 2 * inter, dtype=dtype), "w2_bias": _meta(experts, hidden, dtype=dtype)}
        return lambda: moe.fused_moe(
            _meta(tokens, hidden, dtype=dtype),
            _meta(experts, 2 * inter, hidden, dtype=dtype),
            _meta(experts, hidden, inter, dtype=dtype),
            _meta(tokens, top_k, dtype=torch.float32),
            _meta(tokens, top_k, dtype=torch.int32),
            **(biases if bias else {}),
            activation="swiglu_oai" if bias else "silu",
        )

    return [
        ("fused_moe qwen3-moe decode bf16", moe, kernels, call(64, 128, 8, 2048, 768)),
        ("fused_moe qwen3-moe prefill bf16", moe, kernels, call(4096, 128, 8, 2048, 768)),
        ("fused_moe qwen3-moe prefill fp16", moe, kernels, call(4096, 128, 8, 2048, 768, dtype=torch.float16)),
        ("fused_moe qwen3-moe decode fp32", moe, kernels, call(64, 128, 8, 2048, 768, dtype=torch.float32)),
        ("fused_moe mixtral decode bf16", moe, kernels, call(8, 8, 2, 4096, 14336)),
        ("fused_moe mixtral prefill bf16", moe, kernels, call(4096, 8, 2, 4096, 14336)),
        ("fused_moe gpt-oss prefill bf16", moe, kernels, call(4096, 32, 4, 2880, 2880, bias=True)),
    ]  # fmt: skip


def _ptx_ok(kernel_name: str, ptx: str) -> bool:
    """Code-generation properties some kernels rely on. copy_blocks: 16-byte loads and stores. Sampling: IEEE
    division and no approximate log (the noise and the scaled logits must be bit-identical to torch's)."""
    if kernel_name == "_copy_blocks_kernel":
        return bool(re.search(r"ld\.global\S*\.v4\.b32", ptx)) and bool(re.search(r"st\.global\S*\.v4\.b32", ptx))
    if kernel_name == "_gumbel_argmax_partial_kernel":
        return "div.rn.f32" in ptx and not re.search(r"div\.(approx|full)|lg2\.approx", ptx)
    return True


def _launch_and_record(module, kernel_names: list[str], launch: Callable[[], object]):
    """Run the launcher with every named kernel swapped for a recorder; returns [(kernel, args, kwargs)]."""
    recorders: dict[str, _LaunchRecorder] = {}
    with _recording_all(module, kernel_names, recorders):
        launch()
    return [(recorders[name].kernel, *call) for name in kernel_names for call in recorders[name].calls]


@contextmanager
def _recording_all(module, kernel_names: list[str], recorders: dict):
    if not kernel_names:
        yield
        return
    with _recording(module, kernel_names[0]) as recorder:
        recorders[kernel_names[0]] = recorder
        with _recording_all(module, kernel_names[1:], recorders):
            yield


def main() -> int:
    if not isinstance(decode_attention._decode_partition_kernel, JITFunction):
        print("compile_check: kernels were defined under TRITON_INTERPRET=1; rerun with TRITON_INTERPRET=0")
        return 2
    failures = 0
    for label, module, kernel_names, launch in _production_calls():
        recorded = _launch_and_record(module, kernel_names, launch)
        if len(recorded) != len(kernel_names):
            print(f"FAIL {label}: expected launches of {kernel_names}, recorded {len(recorded)}")
            failures += 1
            continue
        for kernel, args, kwargs in recorded:
            try:
                compiled = compile_recorded(kernel, args, kwargs)
            except Exception as error:  # report every kernel, not just the first failure
                print(f"FAIL {label} {kernel.__name__}: {type(error).__name__}: {error}")
                failures += 1
                continue
            shared = compiled.metadata.shared
            fits = shared <= SM90_MAX_SHARED_BYTES and _ptx_ok(kernel.__name__, compiled.asm["ptx"])
            failures += not fits
            usage = ptxas_usage(compiled.asm["ptx"])
            # Spills are reported, not failed: they cost speed, not correctness.
            regs = ""
            if usage:
                ctas = ctas_per_sm(usage[0], shared, compiled.metadata.num_warps)
                regs = (
                    f", {usage[0]} registers, {usage[1]} bytes spilled, {compiled.metadata.num_warps} warps: "
                    f"{ctas} CTAs/SM"
                )
            print(f"{'ok  ' if fits else 'FAIL'} {label} {kernel.__name__}: {shared} bytes shared memory{regs}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
