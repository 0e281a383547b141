"""A private Redis Cluster (three masters, no replicas) on 127.0.0.1 in a temporary folder: what `pagedq bench
fleet --cluster` runs its workers against. Needs redis-server and a redis-cli that can `--cluster create` (5.0+)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from redis import Redis

from pagedq.worker.ops.embedded_redis import find_redis_server, free_port

MASTERS = 3


class EmbeddedCluster:
    """Start with ``with EmbeddedCluster() as cluster: cluster.url``. No persistence: a scratch cluster."""

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError("a Redis Cluster needs redis-cli (apt-get install redis-server)")
        self.cli = cli
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen] = []
        self._folder: Path | None = None

    @property
    def url(self) -> str:
        """A cluster URL of the first node (the client discovers the others)."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}/0"

    def start(self, timeout_s: float = 30.0) -> EmbeddedCluster:
        self._folder = Path(tempfile.mkdtemp(prefix="pagedq-cluster-"))
        self.ports = _free_ports(MASTERS)
        try:
            for port in self.ports:
                self.procs.append(self._launch(port))
            for port, proc in zip(self.ports, self.procs):
                _wait_up(port, proc, timeout_s)
            nodes = [f"127.0.0.1:{port}" for port in self.ports]
            create = [self.cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"]
            subprocess.run(create, check=True, capture_output=True, timeout=timeout_s)
            _wait_ok(self.ports, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, port: int) -> subprocess.Popen:
        args = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes"]
        args += ["--cluster-config-file", f"nodes-{port}.conf", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self._folder), "--logfile", f"redis-{port}.log"]
        return subprocess.Popen(args, cwd=self._folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(timeout=10)
        self.procs = []
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_ports(count: int) -> list[int]:
    """Distinct free ports whose cluster bus port (port + 10000) exists too."""
    ports: set[int] = set()
    while len(ports) < count:
        port = free_port()
        if port + 10000 <= 65535:
            ports.add(port)
    return sorted(ports)


def _wait_up(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}")
        try:
            if Redis(port=port, socket_connect_timeout=0.2).ping():
                return
        except Exception:  # not listening yet
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer in {timeout_s}s")


def _wait_ok(ports: list[int], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if all(Redis(port=port).cluster("INFO").get("cluster_state") == "ok" for port in ports):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the cluster on ports {ports} did not reach cluster_state:ok in {timeout_s}s")
