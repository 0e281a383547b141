"""The Kustomize merge deploy/kubernetes/ uses, in Python: resources (files and folders), components (their resources,
then their patches) and JSON 6902 patches with a kind/name target, in Kustomize's order. The tests render with it
everywhere (CI installs no kubectl) and, where a kubectl is at hand, check that kubectl's own rendering agrees."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

KUBECTL = shutil.which("kubectl")


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize FOLDER` prints, in no particular order."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    objects = _resources(folder, spec)
    for component in spec.get("components", []):
        objects = _component(folder / component, objects)
    return _patched(spec, objects)


def render_with_kubectl(folder: Path) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=60, check=True)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def _resources(folder: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = folder / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return objects


def _component(folder: Path, objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert spec["kind"] == "Component", folder
    return _patched(spec, objects + _resources(folder, spec))


def _patched(spec: dict[str, Any], objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    objects = copy.deepcopy(objects)
    for patch in spec.get("patches", []):
        target, ops = patch["target"], yaml.safe_load(patch["patch"])
        hits = [o for o in objects if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert hits, f"patch target {target} matches nothing"
        for obj in hits:
            for op in ops:
                _apply(obj, op)
    return objects


def _apply(doc: dict[str, Any], op: dict[str, Any]) -> None:
    """One JSON Patch (RFC 6902) operation: add, replace or remove."""
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in op["path"].split("/")[1:]]
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if op["op"] == "remove":
        del node[int(last) if isinstance(node, list) else last]
    elif isinstance(node, list):
        if last == "-":
            node.append(op["value"])
        elif op["op"] == "add":
            node.insert(int(last), op["value"])
        else:
            node[int(last)] = op["value"]
    else:
        assert op["op"] == "add" or last in node, f"replace of a missing {op['path']}"
        node[last] = op["value"]
