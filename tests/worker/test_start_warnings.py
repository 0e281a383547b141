"""A worker on the real engine without xgrammar says so at start (issue 35, item 9), rather than only refusing each
structured request when it comes; with xgrammar (the `worker` extra installs it) it says nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedq.engine.structured_output import backend

from .helpers import REPO

# makes xgrammar unimportable, as on a machine where it is not installed
BLOCK_XGRAMMAR = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] == 'xgrammar':\n"
    "            raise ImportError('blocked ' + name)\n"
    "sys.meta_path.insert(0, Block())\n"
)


def _warnings(redis_url: str, model: Path, prelude: str) -> list[dict]:
    argv = ["worker", "--redis", redis_url, "--model", str(model), "--device", "cpu", "--burst", "--block-ms", "100"]
    code = f"{prelude}from pagedq.worker.cli.main import main\nraise SystemExit(main({argv!r}))\n"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stderr.splitlines() if '"structured_outputs_unavailable"' in line]


@pytest.mark.slow  # a worker process on the tiny checkpoint
def test_a_worker_without_xgrammar_warns_at_start(redis_url: str, tiny_llama_dir: Path) -> None:
    [warning] = _warnings(redis_url, tiny_llama_dir, BLOCK_XGRAMMAR)
    assert warning["level"] == "warning"
    assert warning["hint"].startswith("structured_outputs needs xgrammar: pip install 'xgrammar==")


def test_the_check_finds_xgrammar_where_it_is_installed() -> None:
    """The tests' environment has it (the worker extra): a worker here starts without the warning."""
    assert backend.installed()
