"""The CI scripts, the worker image and the compose file agree with the code they drive (issue 12).

No Docker engine runs here, so these read the files: the worker command the image runs parses with the real
worker CLI, its HEALTHCHECK asks a path the metrics server serves, and compose validates against the
compose-spec schema.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "docker" / "worker-gpu.Dockerfile").read_text()


def _json_instruction(name: str) -> list[str]:
    """The exec-form (JSON array) argument list of the Dockerfile's last NAME instruction (its options and line
    continuations skipped: everything up to the first bracket)."""
    matches = re.findall(rf"^{name}\b[^\[]*(\[.*\])\s*$", DOCKERFILE, flags=re.MULTILINE)
    assert matches, f"no exec-form {name} in docker/worker-gpu.Dockerfile"
    return list(json.loads(matches[-1]))


def test_ci_run_is_the_readme_test_command():
    run_line = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert run_line.startswith("bash .ci/setup && bash .ci/lint && "), run_line
    assert f"\n{run_line}\n" in readme, "README's test command and .ci/run differ"


def test_image_command_parses_with_the_worker_cli():
    from pagedq.worker.cli.main import build_parser

    cmd = _json_instruction("CMD")
    assert cmd[:2] == ["sh", "-c"]
    words = shlex.split(cmd[2])
    assert words[:3] == ["exec", "pagedq", "worker"], words
    env = {
        "$PAGEDQ_REDIS_URL": "redis://redis:6379/0",
        "$PAGEDQ_MODEL": "/models/model",
        "${PAGEDQ_WORKER_NAME:-$(hostname)}": "worker-1",
        "$PAGEDQ_METRICS_PORT": "9100",
        "$PAGEDQ_METRICS_ADDR": "0.0.0.0",
    }
    args = build_parser().parse_args(["worker", *(env.get(w, w) for w in words[3:])])
    assert (args.name, args.metrics_port, args.metrics_addr, args.device) == ("worker-1", 9100, "0.0.0.0", "cuda")
    assert "PAGEDQ_METRICS_PORT=9100 PAGEDQ_METRICS_ADDR=0.0.0.0" in DOCKERFILE  # metrics on by default
    assert re.search(r"^EXPOSE 9100$", DOCKERFILE, flags=re.MULTILINE)


def test_image_healthcheck_asks_the_worker_liveness_path():
    from pagedq.worker.ops import metrics

    check = _json_instruction("HEALTHCHECK")
    assert check[:2] == ["python3", "-c"]
    paths = re.findall(r"'http://127\.0\.0\.1:%s(/\w+)'", check[2])
    assert paths == ["/health"], check[2]
    assert 'path == "/health"' in Path(metrics.__file__).read_text()


def test_image_has_what_triton_compiles_its_launcher_with():
    install = re.search(r"apt-get install[^&]*", DOCKERFILE)
    assert install is not None
    packages = set(install.group(0).split())
    assert {"gcc", "libc6-dev", "python3.11-dev", "tini"} <= packages, packages
    cuda = re.search(r"^ARG CUDA_VERSION=(\d+)\.(\d+)\.\d+$", DOCKERFILE, flags=re.MULTILINE)
    torch_cuda = re.search(r"^ARG TORCH_CUDA=cu(\d+)$", DOCKERFILE, flags=re.MULTILINE)
    assert cuda and torch_cuda and torch_cuda.group(1) == cuda.group(1) + cuda.group(2), "base CUDA != torch CUDA"
    assert '--index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" "torch==${TORCH_VERSION}"' in DOCKERFILE


def test_compose_redis_stays_off_public_interfaces_and_workers_have_stable_names():
    """(Its users and passwords: tests/deploy/test_compose_files.py, against deploy/redis/users.acl.)"""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    redis = services["redis"]
    assert all(str(p).startswith("127.0.0.1:") for p in redis.get("ports", [])), redis.get("ports")
    names = {services[n]["environment"]["PAGEDQ_WORKER_NAME"] for n in ("worker", "worker-2")}
    assert names == {"worker-1", "worker-2"}


@pytest.mark.parametrize("compose", ["docker-compose.yml", "broken"])
def test_compose_file_is_checked_against_the_compose_spec(compose: str, tmp_path: Path):
    assert shutil.which("check-jsonschema"), "check-jsonschema missing: .ci/setup installs the lint extra"
    path = ROOT / "docker-compose.yml"
    if compose == "broken":  # the check can fail: a misspelt key is caught
        path = tmp_path / "docker-compose.yml"
        path.write_text((ROOT / "docker-compose.yml").read_text().replace("stop_grace_period:", "stop_grace:"))
    result = subprocess.run(
        ["check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)], capture_output=True, text=True
    )
    assert (result.returncode == 0) == (compose != "broken"), result.stdout + result.stderr
