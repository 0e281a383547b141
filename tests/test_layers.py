"""The shape of the code, from its imports (every import statement, at module level or inside a function or a
TYPE_CHECKING block): under the one import root `pagedq`, engine/ and kernels/ never import worker/ or bench/ (nor
kernels/ engine/); engine/'s and worker/'s packages only import the layers below them; the engine's and kernels'
benchmarks run without the queue stack; nothing inside imports the root's lazy names; no module imports itself
back through others. Module sizes are a budget (a reason on record past it), not a wall."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "pagedq"  # the one import root; its parts are pagedq.engine, pagedq.kernels and pagedq.worker
PARTS = ("engine", "kernels", "worker", "bench")

# worker/'s layers, lowest first: a module may import its own package and the layers below its own; two packages
# on one layer are peers and import neither each other nor anything above. `pagedq.worker` itself (the
# producer-facing names in worker/__init__) sits on top: nothing inside the project imports it.
WORKER_LAYERS: dict[str, int] = {
    "pagedq.worker.logs": 0,
    "pagedq.worker.protocol": 0,
    "pagedq.worker.telemetry": 0,  # tracing (the otel extra): set up from OTEL_*, read by every part that traces
    "pagedq.worker.flags": 1,
    "pagedq.worker.client": 2,
    "pagedq.worker.service": 3,
    "pagedq.worker.bulk": 3,
    "pagedq.worker.celery": 4,
    "pagedq.worker.gateway": 4,
    "pagedq.worker.ops": 5,
    "pagedq.worker.testing": 5,
    # The Worker as its settings describe it: the service loop with the Celery front door and the metrics endpoint,
    # which sit above the service layer the loop is in; bench and cli run it, so it sits below them.
    "pagedq.worker.assembly": 6,
    # Every benchmark (pagedq/bench/): it runs the engine and the worker; the `pagedq` command offers it.
    "pagedq.bench": 7,
    "pagedq.worker.cli": 8,
    "pagedq.worker.__main__": 9,
    # `pagedq worker` with fault injection, for tests that crash worker processes: an entry point like __main__
    "pagedq.worker.testing.faulty_worker": 9,
    "pagedq.worker": 9,
}


# engine/'s layers, lowest first, by the same rule: the data path from a request's parameters to the API.
ENGINE_LAYERS: dict[str, int] = {
    # foundations: the one table of limits, the engine's options, and leaves that import nothing of the engine
    "pagedq.engine.limits": 0,
    "pagedq.engine.errors": 0,  # RequestRejected: a request is at fault
    "pagedq.engine.options": 0,
    "pagedq.engine.step_times": 0,
    "pagedq.engine.startup": 0,
    "pagedq.engine.demo_model": 0,
    "pagedq.engine.stats": 0,
    "pagedq.engine.config": 1,  # model, engine and speculative configuration; the architectures served
    "pagedq.engine.structured_output": 1,  # grammars: constraints, compilation, matchers, per-step masks
    "pagedq.engine.sample": 2,  # sampling parameters and the sampler
    "pagedq.engine.layers": 2,
    "pagedq.engine.lora": 2,  # LoRA adapters: PEFT folders, host cache, slot bookkeeping, the adapted linears
    "pagedq.engine.core": 3,  # requests, blocks, seats, swap, the scheduler and its plan for the runner
    "pagedq.engine.models": 3,
    "pagedq.engine.output": 4,  # outputs, detokenizer, output processor
    "pagedq.engine.step": 5,  # the runner's batch state, step inputs, async steps, draws, post-step
    "pagedq.engine.spec_decode": 6,  # drafts and their verification
    "pagedq.engine.runner": 7,  # the model runner, decode CUDA graphs, memory profiling
    "pagedq.engine.beam_search": 8,
    "pagedq.engine.llm_engine": 9,
    "pagedq.engine.llm": 10,
    "pagedq.engine": 11,  # the package: the API names users import
    "pagedq.engine.cli": 12,
    "pagedq.engine.__main__": 13,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for p in (ROOT / PROJECT).rglob("*.py")}


def part_of(module: str) -> str:
    """engine, kernels or worker for a module inside one of them; "" for the root package itself."""
    names = module.split(".")
    return names[1] if len(names) > 1 else ""


def imports_of(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The project modules `name` imports: `from a.b import c` is a.b.c when that is a module, else a.b."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` where c is not a module of ours
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = project_modules()
    return {name: set(imports_of(name, path, known)) for name, path in known.items()}


def layer_of(module: str, layers: dict[str, int] = WORKER_LAYERS) -> tuple[str, int]:
    for prefix in sorted(layers, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix, layers[prefix]
    raise AssertionError(f"{module} is in no layer: add its package there")


def upward_imports(graph: dict[str, set[str]], parts: tuple[str, ...], layers: dict[str, int]) -> set[tuple[str, str]]:
    """(module, target) for each import, among `parts`, of a package on the same layer or a higher one."""
    upward = set()
    for module, targets in graph.items():
        if part_of(module) not in parts:
            continue
        package, rank = layer_of(module, layers)
        for target in targets:
            if part_of(target) not in parts:
                continue
            target_package, target_rank = layer_of(target, layers)
            if target_package != package and target_rank >= rank:
                upward.add((module, target))
    return upward


def test_engine_and_kernels_never_import_the_queue_side(graph: dict[str, set[str]]) -> None:
    bad = sorted(
        (m, t)
        for m, targets in graph.items()
        if part_of(m) in ("engine", "kernels")
        for t in targets
        if part_of(t) in ("worker", "bench") or (part_of(m) == "kernels" and part_of(t) == "engine")
    )
    assert not bad, f"engine/kernels import upward: {bad}"


def test_worker_packages_import_only_the_layers_below(graph: dict[str, set[str]]) -> None:
    upward = upward_imports(graph, ("worker", "bench"), WORKER_LAYERS)
    assert upward == set(), "imports that run up or sideways between worker/'s layers"


def test_engine_packages_import_only_the_layers_below(graph: dict[str, set[str]]) -> None:
    upward = upward_imports(graph, ("engine",), ENGINE_LAYERS)
    assert upward == set(), "imports that run up or sideways between engine/'s layers"


def runs_without_the_queue_stack(module: str) -> bool:
    """engine/, kernels/ and their benchmarks: what a GPU box with only the engine's dependencies runs."""
    return part_of(module) in ("engine", "kernels") or (
        part_of(module) == "bench" and not module.startswith("pagedq.bench.worker")
    )


def test_the_engines_benchmarks_never_import_the_queue_side(graph: dict[str, set[str]]) -> None:
    bad = sorted(
        (m, t)
        for m, targets in graph.items()
        if part_of(m) == "bench" and runs_without_the_queue_stack(m)
        for t in targets
        if part_of(t) == "worker" or t.startswith("pagedq.bench.worker")
    )
    assert not bad, f"the engine's benchmarks import the queue side: {bad}"


def test_nothing_inside_imports_the_root_package(graph: dict[str, set[str]]) -> None:
    """`pagedq/__init__.py` re-exports engine's and worker's names for users: a part that imported them from there
    would reach across the layers above without the checks above seeing it."""
    assert sorted(m for m, targets in graph.items() if PROJECT in targets) == []


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    """Tarjan's strongly connected components: any component of more than one module is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, f"import circles: {cycles}"


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    """The rules above are only as good as the import reading: a planted circle and upward import are found."""
    known = {"pagedq.worker.protocol.a": tmp_path / "a.py", "pagedq.worker.cli.b": tmp_path / "b.py"}
    known["pagedq.worker.protocol.a"].write_text("def f():\n    from pagedq.worker.cli import b\n")
    known["pagedq.worker.cli.b"].write_text("from ..protocol import a\n")
    found = {n: set(imports_of(n, p, known)) for n, p in known.items()}
    assert found == {
        "pagedq.worker.protocol.a": {"pagedq.worker.cli.b"},
        "pagedq.worker.cli.b": {"pagedq.worker.protocol.a"},
    }
    assert layer_of("pagedq.worker.protocol.a")[1] < layer_of("pagedq.worker.cli.b")[1]
    assert upward_imports(found, ("worker",), WORKER_LAYERS) == {("pagedq.worker.protocol.a", "pagedq.worker.cli.b")}


# A module's size is a budget: past it, look for a seam; a cohesive module may stay past it with its reason on
# record here, up to the ceiling. A reason whose module is back under budget is dropped.
SIZE_BUDGET = {"worker": 300, "engine": 400, "kernels": 400, "bench": 400}
SIZE_CEILING = 600
OVER_BUDGET: dict[str, str] = {
    "pagedq/engine/llm_engine.py": "the whole story of a step, its structured-output hand-offs (four phases) included",
}


def test_modules_keep_to_their_size_budget() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / PROJECT).rglob("*.py")}
    budget = {path: SIZE_BUDGET.get(path.split("/")[1], 0) for path in sizes}  # 0: the root package's own files
    over = {path for path, n in sizes.items() if budget[path] and n > budget[path]}
    assert over - set(OVER_BUDGET) == set(), "past the budget: find a seam, or record why the module is one piece"
    assert set(OVER_BUDGET) - over == set(), "back under budget: drop the recorded reason"
    assert {path: n for path, n in sizes.items() if n > SIZE_CEILING} == {}


# What engine/ and kernels/ may import beyond the standard library and the project (pyproject's core dependencies;
# tqdm comes with transformers). xgrammar is optional (the `structured` extra): only engine/structured_output/backend.py
# imports it, inside a function, so the engine loads and serves everything else on a box without it.
ENGINE_THIRD_PARTY = {"torch", "triton", "transformers", "safetensors", "tokenizers", "numpy", "tqdm"}
# peft is the `test` extra's (the LoRA oracle): only `pagedq bench lora` imports it, inside a function, and says
# so when it is missing.
LAZY_ONLY = {"xgrammar": "pagedq.engine.structured_output.backend", "peft": "pagedq.bench.engine.lora"}


def _third_party_imports(path: Path) -> Iterator[tuple[str, bool]]:
    """(top-level name, imported at module level) of every absolute import of a module outside the project."""
    import sys

    tree = ast.parse(path.read_text(), str(path))
    functions = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
    nested = {id(n) for f in functions for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top != PROJECT and top != "__future__":
                yield top, id(node) not in nested


def test_engine_and_kernels_import_only_their_dependencies_and_xgrammar_lazily() -> None:
    bad, lazy = [], []
    for name, path in project_modules().items():
        if not runs_without_the_queue_stack(name):
            continue
        for top, at_module_level in _third_party_imports(path):
            if top in LAZY_ONLY:
                lazy.append(name)
                if name != LAZY_ONLY[top] or at_module_level:
                    bad.append((name, top, "module level" if at_module_level else "function"))
            elif top not in ENGINE_THIRD_PARTY:
                bad.append((name, top, "not a core dependency"))
    assert not bad, f"engine/kernels imports outside their dependencies: {bad}"
    assert sorted(set(lazy)) == sorted(LAZY_ONLY.values())  # the check sees every lazy import
