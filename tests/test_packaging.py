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
        "        if name.split('.')[0] in {'redis', 'celery', 'pydantic', 'structlog', 'kombu', 'xgrammar'}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import engine, kernels, engine.llm_engine, engine.cli, engine.options, engine.bench.args\n"
        "import engine.structured.manager, engine.structured.compiler, engine.structured.step_mask\n"
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


def test_engine_serves_without_xgrammar_and_refuses_structured_requests_clearly(tiny_llama_dir):
    """The GPU box may lack xgrammar: plain requests run; one carrying structured_outputs is refused at
    add_request with the install hint, and leaves no trace."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'xgrammar':\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from engine import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_llama_dir)!r})\n"
        "try:\n"
        "    llm.llm_engine.add_request('s', 'The quick', SamplingParams(structured_outputs={'regex': 'a+'}))\n"
        "except ValueError as error:\n"
        "    print('refused:', error)\n"
        "out = llm.generate('The quick', SamplingParams(max_tokens=3, ignore_eos=True))\n"
        "print(len(out[0].outputs[0].token_ids), llm.llm_engine.has_unfinished_requests())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("refused: structured_outputs needs xgrammar: pip install 'xgrammar==0.2.8'"), (
        result.stderr
    )
    assert lines[1] == "3 False"
