"""Our `kernels` package must not be mistaken for Hugging Face's `kernels` hub distribution."""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version


def test_transformers_does_not_take_our_kernels_for_hf_kernels():
    import transformers.utils.import_utils as import_utils

    import kernels

    assert hasattr(kernels, "paged_decode_attention")  # ours is what `import kernels` finds
    assert import_utils.is_kernels_available() is False
    assert Version(importlib.metadata.version("pagedq")) < Version(import_utils.KERNELS_MIN_VERSION)


def test_engine_and_kernels_import_without_the_queue_stack():
    import subprocess
    import sys

    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'redis', 'celery', 'pydantic', 'structlog', 'kombu'}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import engine, kernels, engine.llm_engine, engine.cli, engine.options, engine.bench.args\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


def test_producer_client_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys; from worker import Client, AsyncClient; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr
