"""docker-compose.yml and the Dockerfiles it builds, read as docker would: compose's variable interpolation, YAML
anchors and merge keys, profiles, and each service's effective command, environment, healthcheck and ports
(compose's keys over its image's ENTRYPOINT / CMD / ENV / HEALTHCHECK / EXPOSE, as docker applies them).

Nothing here runs anything; tests/deploy/local_stack.py runs the result as local processes.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"

# compose's interpolation: $$ (a literal $), ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}, $VAR
_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_]\w*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>[A-Za-z_]\w*))"
)


class InterpolationError(ValueError):
    """A required variable (${VAR:?message}) is unset or empty: compose stops with this message."""


def interpolate(value: str, env: dict[str, str]) -> str:
    def one(match: re.Match) -> str:
        if match.group("escaped"):
            return "$"
        name = match.group("braced") or match.group("bare")
        op, arg, current = match.group("op"), match.group("arg") or "", env.get(name)
        missing = current is None or (current == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if missing else str(current)
        if op in (":?", "?"):
            if missing:
                raise InterpolationError(f"required variable {name} is missing a value: {arg}")
            return str(current)
        return current or ""

    return _VARIABLE.sub(one, value)


def _interpolate_tree(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_tree(item, env) for key, item in node.items()}
    return node


def load(env: dict[str, str], path: Path = COMPOSE_FILE) -> dict:
    """The compose file with anchors and merge keys resolved (PyYAML does both) and every value interpolated,
    every service's included: compose interpolates the whole file before it applies profiles."""
    return _interpolate_tree(yaml.safe_load(path.read_text()), env)


def enabled(project: dict, profiles: set[str]) -> list[str]:
    """The services `docker compose --profile P ... up` starts: those with no profile and those of an active one."""
    return [
        name for name, svc in project["services"].items() if not svc.get("profiles") or set(svc["profiles"]) & profiles
    ]


@dataclass
class Image:
    """The final stage of a Dockerfile: what a container of it starts with."""

    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    healthcheck: list[str] | None = None
    expose: list[int] = field(default_factory=list)
    user: str | None = None
    stages: list[list[tuple[str, str]]] = field(default_factory=list)  # every stage's (INSTRUCTION, arguments)

    def runs(self, stage: int = -1) -> list[str]:
        return [args for instruction, args in self.stages[stage] if instruction == "RUN"]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments and parser directives dropped."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    out = []
    for line in lines:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _shell_or_exec(args: str) -> list[str]:
    """An instruction's exec form (a JSON array) as is; its shell form as docker runs it (/bin/sh -c)."""
    if args.startswith("["):
        return list(json.loads(args))
    return ["/bin/sh", "-c", args]


def parse_dockerfile(path: Path) -> Image:
    """The final stage's ENV (its ARGs and earlier ENVs substituted), ENTRYPOINT, CMD, HEALTHCHECK, EXPOSE, USER."""
    stages: list[list[tuple[str, str]]] = []
    image, global_args, args = Image(), {}, {}
    for instruction, rest in instructions(path.read_text()):
        if instruction == "FROM":  # a new stage keeps nothing of the last one but the global ARGs
            stages.append([(instruction, rest)])
            image, args = Image(stages=stages), dict(global_args)
            continue
        if not stages:  # before the first FROM only ARGs may stand
            name, _, default = rest.partition("=")
            global_args[name] = default
            continue
        stages[-1].append((instruction, rest))
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default or global_args.get(name, "")
        elif instruction == "ENV":
            for word in shlex.split(rest):
                key, _, value = word.partition("=")
                image.env[key] = interpolate(value, {**args, **image.env})
        elif instruction == "ENTRYPOINT":
            image.entrypoint, image.cmd = _shell_or_exec(rest), []  # a new ENTRYPOINT resets CMD
        elif instruction == "CMD":
            image.cmd = _shell_or_exec(rest)
        elif instruction == "HEALTHCHECK":  # HEALTHCHECK [--options] CMD command | NONE
            image.healthcheck = None if rest == "NONE" else _shell_or_exec(rest[rest.index("CMD ") + 4 :].strip())
        elif instruction == "EXPOSE":
            image.expose += [int(port.split("/")[0]) for port in rest.split()]
        elif instruction == "USER":
            image.user = rest
    return image


@dataclass
class Service:
    """One compose service as its container runs it."""

    name: str
    argv: list[str]
    env: dict[str, str]
    healthcheck: list[str] | None  # argv, as docker exec runs it in the container
    ports: list[int]  # the container's ports (EXPOSE, expose, the container side of ports)
    published: dict[int, int]  # host port -> container port
    image: Image | None  # None: a registry image (redis, prometheus ...), not built here
    image_name: str | None
    depends_on: dict[str, str]  # service -> condition


def _command(value: Any) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def _healthcheck(test: Any) -> list[str] | None:
    if test is None:
        return None
    words = ["CMD-SHELL", test] if isinstance(test, str) else [str(t) for t in test]
    if words[0] == "NONE":
        return None
    return ["/bin/sh", "-c", words[1]] if words[0] == "CMD-SHELL" else words[1:]


def _environment(value: Any) -> dict[str, str]:
    if isinstance(value, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in value)
    return {key: "" if item is None else str(item) for key, item in (value or {}).items()}


def resolve(project: dict, name: str) -> Service:
    svc = project["services"][name]
    image = None
    if "build" in svc:
        build = svc["build"]
        context = ROOT / build.get("context", ".")
        image = parse_dockerfile(context / build.get("dockerfile", "Dockerfile"))
    # compose's entrypoint replaces the image's and drops its CMD; compose's command replaces CMD
    entrypoint = _command(svc["entrypoint"]) if "entrypoint" in svc else (image.entrypoint if image else [])
    image_cmd = [] if "entrypoint" in svc or image is None else image.cmd
    cmd = _command(svc["command"]) if "command" in svc else image_cmd
    health = svc.get("healthcheck", {})
    check = _healthcheck(health["test"]) if "test" in health else (image.healthcheck if image else None)
    if health.get("disable"):
        check = None
    published = {}
    for port in svc.get("ports", []):
        parts = str(port).split(":")
        published[int(parts[-2])] = int(parts[-1].split("/")[0])
    container_ports = sorted({*(image.expose if image else []), *map(int, svc.get("expose", [])), *published.values()})
    depends = svc.get("depends_on", {})
    conditions = (
        {d: "service_started" for d in depends}
        if isinstance(depends, list)
        else {d: spec.get("condition", "service_started") for d, spec in depends.items()}
    )
    return Service(
        name=name,
        argv=entrypoint + cmd,
        env={**(image.env if image else {}), **_environment(svc.get("environment"))},
        healthcheck=check,
        ports=container_ports,
        published=published,
        image=image,
        image_name=svc.get("image"),
        depends_on=conditions,
    )
