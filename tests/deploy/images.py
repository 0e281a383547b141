"""What an image installs, worked out from this machine's installed metadata: the distributions pip would bring
for docker/requirements.py's list (dependencies followed, markers and extras evaluated), and so the top-level
modules that are here but would not be in the image."""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from collections.abc import Iterable

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

OWN = frozenset({"engine", "kernels", "worker", "tests"})  # the project itself (installed with --no-deps)


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


def modules_not_in(image_distributions: set[str]) -> set[str]:
    """Top-level modules installed here by distributions the image lacks (the standard library never)."""
    out = set()
    for module, dists in metadata.packages_distributions().items():
        if module in OWN or module in sys.stdlib_module_names or module.startswith("__editable__"):
            continue
        if not any(canonicalize_name(d) in image_distributions for d in dists):
            out.add(module)
    return out
