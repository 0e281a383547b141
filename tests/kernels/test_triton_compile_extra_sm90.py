"""copy_blocks and gumbel_argmax compile for sm_90 without a GPU, with the PTX properties they rely on
(16-byte copies; IEEE division and no approximate log in the sampler). See kernels/compile_check_extra.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_copy_and_sampling_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check_extra"], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert report.count("ok  ") == 3, report
