"""`-m "not slow"` is a real fast lane: every test that loads the demo model or starts a `python -m pagedq.worker`
process (itself, through a helper, or through a fixture) carries the `slow` marker.

The markers are read from a real collection of tests/ (so `pytestmark`, decorators and parametrize marks all count);
what a test does is read from the source of the functions under tests/."""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# Using one of these loads SmolLM2 (pagedq/engine/demo_model.py).
DEMO_NAMES = frozenset({"demo_model_dir", "demo_model_path"})
# Modules whose use means another process runs.
PROCESS_MODULES = frozenset({"multiprocessing", "concurrent.futures.process"})

# Files other helpers own, whose process-starting tests are not marked yet. Drop an entry once its file is marked.
NOT_YET_MARKED: dict[str, str] = {}  # file -> why its tests are exempt (none are)


def _starts_a_process_itself(tree: ast.AST) -> bool:
    """`[..., "-m", "pagedq.worker", ...]` in an argument list, or a process pool/`multiprocessing` in use."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            if any(a == "-m" and b == "pagedq.worker" for a, b in itertools.pairwise(words)):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any(name in PROCESS_MODULES for name in names if name):
                return True
    return False


def _names_used(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }


def _process_starters() -> set[str]:
    """Every function (helper or fixture) defined under tests/ that starts a process, directly or through another."""
    functions: dict[str, list[ast.AST]] = {}
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.setdefault(node.name, []).append(node)
    starters = {name for name, defs in functions.items() if any(_starts_a_process_itself(d) for d in defs)}
    while True:  # to a fixpoint: a helper that calls a starter is one
        more = {
            name
            for name, defs in functions.items()
            if name not in starters and any(_names_used(d) & starters for d in defs)
        }
        if not more:
            return starters
        starters |= more


class _Keep:
    """A plugin that keeps the collected items of a `--collect-only` run."""

    def __init__(self) -> None:
        self.items: list[pytest.Item] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = list(session.items)


@pytest.fixture(scope="module")
def collected() -> list[pytest.Item]:
    keep = _Keep()
    code = pytest.main(
        ["--collect-only", "-qq", "-p", "no:cacheprovider", "--rootdir", str(ROOT), str(TESTS)], plugins=[keep]
    )
    assert code == pytest.ExitCode.OK, f"collecting tests/ failed: {code!r}"
    return keep.items


def _needs_slow(item: pytest.Item, starters: set[str]) -> str | None:
    """Why the test must be marked slow, or None."""
    function = getattr(item, "function", None)
    if function is None:
        return None
    uses = set(getattr(item, "fixturenames", ()))
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    if _starts_a_process_itself(tree):
        return "starts `python -m pagedq.worker` itself"
    uses |= _names_used(tree)
    if uses & DEMO_NAMES:
        return f"loads the demo model ({', '.join(sorted(uses & DEMO_NAMES))})"
    if uses & starters:
        return f"starts a process through {', '.join(sorted(uses & starters))}"
    return None


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def test_every_demo_model_or_process_test_is_marked_slow(collected: list[pytest.Item]) -> None:
    starters = _process_starters()
    unmarked = []
    for item in collected:
        why = _needs_slow(item, starters)
        if why and item.get_closest_marker("slow") is None and _file(item) not in NOT_YET_MARKED:
            unmarked.append(f"{item.nodeid}: {why}")
    assert not unmarked, "mark these @pytest.mark.slow (or pytestmark for a whole module):\n" + "\n".join(unmarked)


def test_the_check_sees_the_known_cases(collected: list[pytest.Item]) -> None:
    """Not vacuous: the helpers that start processes are found, and so are tests known to need the marker."""
    starters = _process_starters()
    assert {"start_worker", "start_gateway_process", "run_cli", "worker_cmd"} <= starters, sorted(starters)
    assert "wait_for" not in starters and "worker_thread" not in starters
    flagged = {item.nodeid for item in collected if _needs_slow(item, starters)}
    for known in (
        "tests/worker/test_cli.py::test_demo_answers_on_the_demo_model",
        "tests/engine/test_demo_model.py::test_demo_model_answers_paris",
        "tests/gateway/test_bench.py::test_bench_gateway_reports_native_and_gateway_figures",
    ):
        assert known in flagged, f"{known} is not seen as a slow test"
    assert any(nodeid.startswith("tests/worker/test_processes.py::") for nodeid in flagged)
    assert not any(nodeid.startswith("tests/engine/test_scheduler.py::") for nodeid in flagged)
    for path in NOT_YET_MARKED:
        assert (ROOT / path).exists(), f"{path} is gone: drop it from NOT_YET_MARKED"
