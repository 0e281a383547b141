"""Every kernel compiles for sm_90 (H100/H200) with production shapes, without a GPU.

The interpreter runs kernels as NumPy code, so it cannot catch what only the compiler enforces (loop-carried
types, tl.dot shape rules, shared memory). `kernels.compile_check` compiles through Triton's bundled LLVM and
ptxas; it needs the kernels defined un-interpreted, hence a subprocess with TRITON_INTERPRET=0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _compile_report() -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "pagedq.kernels.compile_check"], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )


def test_all_kernels_compile_for_sm90():
    result = _compile_report()
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert report.count("ok  ") >= 17, report
    # Prefill attention, every dtype: no spills and room for at least two CTAs per SM (one left the SM idle
    # whenever its CTA waited on memory).
    prefill = re.findall(r"^ok   prefill (\w+) .*, (\d+) bytes spilled, \d+ warps: (\d+) CTAs/SM$", report, re.M)
    assert {dtype for dtype, _, _ in prefill} == {"bf16", "fp16", "fp32"}, report
    assert all(int(spilled) == 0 and int(ctas) >= 2 for _, spilled, ctas in prefill), prefill
    # Batched LoRA, decode and prefill: every launch compiles; the bf16 ones do not spill.
    lora_lines = re.findall(r"^ok   lora_(?:shrink|expand) (\w+) (\w+) .*, (\d+) bytes spilled", report, re.M)
    assert len(lora_lines) == 12, report
    assert all(int(spilled) == 0 for _, dtype, spilled in lora_lines if dtype == "bf16"), lora_lines
