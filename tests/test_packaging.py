"""pagedq is one import root. Its wheel installs beside Hugging Face's `kernels` distribution (which transformers
requires since 5.25) and runs from any folder; the engine and kernels import without the queue stack; a producer
loads no torch."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from tests.engine.parity import assert_greedy_parity, hf_greedy

ROOT = Path(__file__).resolve().parent.parent
EOS_ID = 2  # the tiny checkpoints' (tests/conftest.py)


def _python(code: str, cwd: Path, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    """`python -c CODE` in `cwd`, with no PYTHONPATH: imports resolve as an installed package's do."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([python, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _blocking(*tops: str) -> str:
    """Code that makes these top-level packages unimportable, as on a machine without them."""
    return (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {set(tops)!r}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )


def test_hugging_face_kernels_and_ours_coexist(tmp_path: Path) -> None:
    """`import kernels` is Hugging Face's, `import pagedq.kernels` ours, and transformers' hub-kernel check reads
    Hugging Face's distribution, not pagedq's (the old layout put our `kernels` where theirs belongs)."""
    code = (
        "import importlib.metadata as md, json\n"
        "import kernels, pagedq.kernels\n"
        "from transformers.utils import import_utils\n"
        "found, version = import_utils._is_package_available('kernels', return_version=True)\n"
        "names = md.packages_distributions()\n"
        "print(json.dumps({'theirs': kernels.__file__, 'theirs_is_ours': hasattr(kernels, 'KernelSet'),\n"
        "    'ours': pagedq.kernels.__file__, 'ours_binds': callable(pagedq.kernels.bind),\n"
        "    'kernels_from': sorted(names.get('kernels', [])), 'pagedq_from': sorted(names.get('pagedq', [])),\n"
        "    'hub_check_version': version, 'hf_kernels_version': md.version('kernels'),\n"
        "    'pagedq_version': md.version('pagedq'),\n"
        "    'hub_check_ran': isinstance(import_utils.is_kernels_available(), bool)}))\n"
    )
    result = _python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert not seen["theirs_is_ours"] and seen["ours_binds"]
    assert Path(seen["ours"]).parent.parent.name == "pagedq" and Path(seen["theirs"]).parent.parent.name != "pagedq"
    assert seen["kernels_from"] == ["kernels"], "only Hugging Face's distribution may provide the `kernels` name"
    assert seen["pagedq_from"] == ["pagedq"]
    assert seen["hub_check_version"] == seen["hf_kernels_version"] != seen["pagedq_version"]
    assert seen["hub_check_ran"]


def test_engine_and_kernels_import_without_the_queue_stack():
    blocker = (
        _blocking("redis", "celery", "pydantic", "structlog", "kombu", "xgrammar")
        + "import pagedq, pagedq.engine, pagedq.kernels, pagedq.engine.llm_engine, pagedq.engine.cli\n"
        "import pagedq.engine.options, pagedq.bench.engine.args\n"
        "import pagedq.engine.structured_output.manager, pagedq.engine.structured_output.compiler\n"
        "import pagedq.engine.structured_output.step_mask\n"
        "from pagedq import LLM, SamplingParams\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


def test_producer_client_does_not_import_torch():
    """The root's names resolve lazily: a producer's `from pagedq import Client` stays as light as the client."""
    code = (
        "import sys, pagedq, pagedq.worker\n"
        "from pagedq import Client, AsyncClient, JobFailed\n"
        "from pagedq.worker import Client as WorkerClient\n"
        "print(Client is WorkerClient, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "True False", result.stderr


def test_the_root_package_names_what_it_exports() -> None:
    import pagedq as root
    from pagedq.engine import LLM
    from pagedq.worker import AsyncClient

    assert root.LLM is LLM and root.AsyncClient is AsyncClient
    assert set(root.__all__) <= set(dir(root))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = root.Nope


def test_the_worker_extra_installs_the_structured_outputs_backend() -> None:
    """A worker serves structured requests from the start (issue 35): `pagedq[worker]` carries xgrammar at the
    `structured` extra's pin (the engine-only install), which the lock (.ci/constraints.txt) holds."""
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {
        extra: [str(Requirement(line).specifier) for line in optional[extra] if Requirement(line).name == "xgrammar"]
        for extra in ("worker", "structured")
    }
    assert len(pins["worker"]) == 1 and pins["worker"] == pins["structured"], pins
    locked = [line.strip() for line in (ROOT / ".ci/constraints.txt").read_text().splitlines()]
    assert f"xgrammar{pins['worker'][0]}" in locked


def test_engine_serves_without_xgrammar_and_refuses_structured_requests_clearly(tiny_llama_dir):
    """The GPU box may lack xgrammar: plain requests run; one carrying structured_outputs is refused at
    add_request with the install hint, and leaves no trace."""
    code = (
        _blocking("xgrammar") + "from pagedq.engine import LLM, SamplingParams\n"
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


# --- the wheel, installed as a user installs it --------------------------------------------------------------------


def _package_files(top: Path) -> set[str]:
    """Every file of the `pagedq` package in a source tree, as wheel paths (no bytecode caches)."""
    return {
        str(p.relative_to(top.parent))
        for p in (top).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, the venv's python): the wheel built from a copy of the source tree and installed with --no-deps
    into a fresh venv that sees this interpreter's packages (torch, transformers, Hugging Face's `kernels`) but
    not the checkout."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "pagedq", source / "pagedq", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", base / "dist", source],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (base / "dist").glob("pagedq-*.whl")
    venv.create(base / "venv", with_pip=False, symlinks=True)
    python = base / "venv" / "bin" / "python"
    # What --system-site-packages gives, from this interpreter (itself a venv under .ci/latest): its site-packages,
    # after the venv's own. Their .pth files do not run, so the checkout's editable install stays out of sight.
    purelib = _python("import sysconfig; print(sysconfig.get_paths()['purelib'])", base, str(python)).stdout.strip()
    Path(purelib, "runner-site.pth").write_text("".join(f"{path}\n" for path in site.getsitepackages()))
    # This interpreter's pip installs into the venv (--python); -I (--ignore-installed): the editable install's
    # metadata, which it sees beside the site-packages, is not this wheel.
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", "-I", wheel],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    return wheel, python


@pytest.mark.slow
def test_the_wheel_holds_one_import_root_and_every_file_the_package_reads(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    outside = sorted(n for n in names if n.split("/")[0] != "pagedq" and not n.split("/")[0].endswith(".dist-info"))
    assert outside == [], "the wheel writes outside its own package folder"
    shipped = {n for n in names if n.startswith("pagedq/")}
    assert shipped == _package_files(ROOT / "pagedq"), "every file of the package ships: the C source, py.typed..."
    assert {"pagedq/kernels/cpu_native.c", "pagedq/py.typed"} <= shipped
    assert "pagedq = pagedq.worker.cli:main" in entry_points


@pytest.mark.slow
def test_the_installed_wheel_imports_every_module_from_another_folder(installed: tuple[Path, Path], tmp_path):
    _, python = installed
    code = (
        "import importlib, json, pkgutil, sys, kernels, pagedq\n"
        "names = [m.name for m in pkgutil.walk_packages(pagedq.__path__, 'pagedq.')]\n"
        "failed = {}\n"
        "for name in names:\n"
        "    if name.endswith('__main__'):\n"
        "        continue  # runs the command\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as error:\n"
        "        failed[name] = repr(error)\n"
        "print(json.dumps({'root': pagedq.__file__, 'hf_kernels': kernels.__file__, 'modules': names,\n"
        "                  'failed': failed, 'version': pagedq.__version__}))\n"
    )
    result = _python(code, tmp_path, str(python))
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["failed"] == {}
    assert Path(seen["root"]).is_relative_to(python.parent.parent), "the venv's copy, not the checkout's"
    assert not Path(seen["hf_kernels"]).is_relative_to(python.parent.parent)
    sources = [Path(n).with_suffix("").parts for n in _package_files(ROOT / "pagedq") if n.endswith(".py")]
    modules = {".".join(parts[:-1] if parts[-1] == "__init__" else parts) for parts in sources}
    assert {"pagedq", *seen["modules"]} == modules, "every module of the checkout is in the wheel, and imports"
    version = subprocess.run([python.parent / "pagedq", "--version"], cwd=tmp_path, capture_output=True, text=True)
    assert version.stdout.strip() == f"pagedq {seen['version']}", version.stderr


@pytest.mark.slow
def test_the_installed_wheel_generates_as_transformers_does(installed: tuple[Path, Path], tiny_llama_dir, tmp_path):
    """Greedy tokens through the installed wheel's offline API, against transformers' generate; then its `pagedq
    generate` command prints the same continuation. The native CPU kernel is built from the wheel's own C source
    into an empty cache, so a missing file would fail here."""
    import transformers

    _, python = installed
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompt = "Paged attention stores"
    prompt_ids = tokenizer(prompt).input_ids
    env_code = f"import os; os.environ['PAGEDQ_NATIVE_CACHE'] = {str(tmp_path / 'native')!r}\n"
    code = env_code + (
        "import json\n"
        "from pagedq import LLM, SamplingParams\n"
        "from pagedq.kernels import cpu_native\n"
        f"llm = LLM({str(tiny_llama_dir)!r})\n"
        "params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)\n"
        f"out = llm.generate([{prompt_ids!r}], params)\n"
        "print(json.dumps({'tokens': list(out[0].outputs[0].token_ids), 'native': cpu_native.available(),\n"
        "                  'source': str(cpu_native.SOURCE)}))\n"
    )
    result = _python(code, tmp_path, str(python))
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["native"] and Path(seen["source"]).is_relative_to(python.parent.parent)
    assert list((tmp_path / "native").glob("*.so")), "the kernel was built from the installed source"

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype="float32")
    theirs, logits = hf_greedy(model, prompt_ids, 12)
    assert assert_greedy_parity(seen["tokens"], theirs, logits) == 0

    command = [python.parent / "pagedq", "generate", prompt, "--model", str(tiny_llama_dir), "--max-tokens", "12"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cli = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    until_eos = seen["tokens"][: seen["tokens"].index(EOS_ID)] if EOS_ID in seen["tokens"] else seen["tokens"]
    expected = tokenizer.decode(until_eos, skip_special_tokens=True)
    assert cli.stdout.startswith(f"### {prompt}\n{expected}\n["), cli.stdout
