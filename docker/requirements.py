"""The Python requirements each pagedq image installs, read from pyproject.toml (the one list of dependencies).

    python docker/requirements.py gateway                 # one requirement a line, for `pip install -r`
    python docker/requirements.py worker-cpu --no-deps    # what the image installs with `pip install --no-deps`

The images install the project itself with `pip install --no-deps .` after these, so what an image leaves out of
pyproject's lists stays out:
  gateway     the `worker` extra and the engine's dependencies but torch, triton and xgrammar (which declares
              both; structured outputs are the workers'): `pagedq serve`, `status`,
              `dlq` and `bulk` import no torch (tests/test_settings_env.py); numpy is used by
              pagedq/worker/protocol/limits.py, transformers (with tokenizers) by /tokenize and /detokenize, which load
              the tokenizer the workers publish (pagedq/worker/gateway/tokenize.py; transformers without torch).
  worker-cpu  the engine's dependencies without torch (the Dockerfile installs torch's CPU wheel first, from
              PyTorch's CPU index) and without triton (on the CPU the kernels are the PyTorch reference;
              pagedq/kernels/__init__.py imports Triton only for its backend), plus the `worker` and `demo` extras
              (`demo` converts the demo model at build time; the runtime stage drops it) but xgrammar, which is
              installed without its dependencies (NO_DEPS below).
What an image leaves out is left out of the extras' lists too.
tests/deploy/ runs each service with the modules its image lacks made unimportable.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
# image -> (the extras, the distributions left out of the engine's dependencies and of the extras)
IMAGES: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "gateway": (("worker",), frozenset({"torch", "triton", "xgrammar"})),
    "worker-cpu": (("worker", "demo"), frozenset({"torch", "triton", "xgrammar"})),
}
# image -> the extras installed without their dependencies: xgrammar (structured outputs) declares triton, which
# the CPU path never imports (its CPU bitmask kernel is C++); apache-tvm-ffi is the one dependency of it the
# image does not already hold.
NO_DEPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gateway": ((), ()),
    "worker-cpu": (("structured",), ("apache-tvm-ffi",)),
}


def distribution(requirement: str) -> str:
    """The normalised distribution name a requirement line names (`celery[redis]>=5.4` -> `celery`)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(image: str, pyproject: Path = PYPROJECT) -> list[str]:
    if image not in IMAGES:
        raise SystemExit(f"unknown image {image!r}: one of {', '.join(IMAGES)}")
    project = tomllib.loads(pyproject.read_text())["project"]
    extras, left_out = IMAGES[image]
    lines = [line for line in project["dependencies"] if distribution(line) not in left_out]
    for extra in extras:
        lines += [line for line in project["optional-dependencies"][extra] if distribution(line) not in left_out]
    return lines


def no_deps_requirements(image: str, pyproject: Path = PYPROJECT) -> list[str]:
    """What the image installs after `requirements(image)`, each without its declared dependencies."""
    if image not in NO_DEPS:
        raise SystemExit(f"unknown image {image!r}: one of {', '.join(NO_DEPS)}")
    extras, extra_lines = NO_DEPS[image]
    optional = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    return [line for extra in extras for line in optional[extra]] + list(extra_lines)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] != "--no-deps"):
        raise SystemExit(f"usage: python {sys.argv[0]} {{{'|'.join(IMAGES)}}} [--no-deps]")
    lines = no_deps_requirements(sys.argv[1]) if len(sys.argv) == 3 else requirements(sys.argv[1])
    print("\n".join(lines))
