"""sm_90 compile check of the kernels added after `kernels.compile_check` was written: copy_blocks and
gumbel_argmax. `python -m kernels.compile_check_extra` (TRITON_INTERPRET unset or 0; no GPU needed).

Reuses compile_check's recorder and compiler; the entries of `extra_calls` can move into
compile_check._production_calls as they are. Also checks the PTX: copy_blocks moves 16 bytes per load and
store (its per-cache offsets are scaled by a constexpr so that the compiler can prove the alignment), and
gumbel_argmax divides with IEEE rounding and uses no approximate log.
"""

from __future__ import annotations

import re
import sys

import torch
from triton.runtime.jit import JITFunction

from kernels import block_copy, sampling
from kernels.compile_check import SM90_MAX_SHARED_BYTES, _launch_and_record, _meta, compile_recorded, ptxas_usage


def extra_calls():
    """(label, module, kernel names, launcher call) with production shapes (32 layers, Llama-8B-like cache)."""
    caches = [_meta(4096, 16, 8, 128) for _ in range(64)]
    mapping = _meta(64, 2, dtype=torch.int64)
    logits, temps = _meta(256, 151936, dtype=torch.float32), _meta(256, dtype=torch.float32)
    seeds, positions = _meta(256, dtype=torch.int64), _meta(256, dtype=torch.int64)
    kernels = ["_gumbel_argmax_partial_kernel", "_gumbel_argmax_reduce_kernel"]
    return [
        ("copy_blocks bf16", block_copy, ["_copy_blocks_kernel"],
         lambda: block_copy.copy_blocks(caches[:32], caches[32:], mapping)),
        ("gumbel_argmax 4 splits", sampling, kernels,
         lambda: sampling.gumbel_argmax_split(logits, temps, seeds, positions, 4)),
    ]  # fmt: skip


def _ptx_ok(kernel_name: str, ptx: str) -> bool:
    """copy_blocks: 16-byte loads and stores. Sampling: IEEE division, no approximate log/division (the noise
    and the scaled logits must be bit-identical to torch's)."""
    if kernel_name == "_copy_blocks_kernel":
        return bool(re.search(r"ld\.global\S*\.v4\.b32", ptx)) and bool(re.search(r"st\.global\S*\.v4\.b32", ptx))
    if kernel_name == "_gumbel_argmax_partial_kernel":
        return "div.rn.f32" in ptx and not re.search(r"div\.(approx|full)|lg2\.approx", ptx)
    return True


def main() -> int:
    if not isinstance(block_copy._copy_blocks_kernel, JITFunction):
        print("compile_check_extra: kernels were defined under TRITON_INTERPRET=1; rerun with TRITON_INTERPRET=0")
        return 2
    failures = 0
    for label, module, kernel_names, launch in extra_calls():
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
            ptx = compiled.asm["ptx"]
            ok = compiled.metadata.shared <= SM90_MAX_SHARED_BYTES and _ptx_ok(kernel.__name__, ptx)
            failures += not ok
            usage = ptxas_usage(ptx)
            regs = f", {usage[0]} registers, {usage[1]} bytes spilled" if usage else ""
            print(f"{'ok  ' if ok else 'FAIL'} {label} {kernel.__name__}: {compiled.metadata.shared} bytes shared{regs}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
