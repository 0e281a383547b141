"""Flags that are also PAGEDQ_* environment variables, from one list of `Option`s per command.

Each option is declared once (in a settings dataclass's field metadata, in pagedq/engine/options.py, or in a command's
OPTIONS); from it come the argparse flag, its help (with the default and the variable) and a pydantic-settings
model that validates. Precedence: flag > environment > default. The environment is read only while a command line
is parsed (`SettingsParser`), never when code builds WorkerSettings(...) itself.

(pydantic-settings' CliSettingsSource was tried first: it takes a field's CLI name from its alias, and an alias
also replaces the env name without the prefix, so `--redis`/`--result-ttl` could not sit next to
PAGEDQ_REDIS_URL/PAGEDQ_RESULT_TTL without renaming WorkerSettings fields all over pagedq/worker/ and the tests; its
help shows `{str,null}`-style metavars. What is kept of it: BaseSettings reads and validates the environment.)
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal, cast

from pydantic import BeforeValidator, Field, StringConstraints, ValidationError, create_model
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from pagedq.engine.cli import StrictArgumentParser
from pagedq.engine.options import engine_options, value_type
from pagedq.worker.protocol.keys import QUEUE_PATTERN

ENV_PREFIX = "PAGEDQ_"


@dataclass(frozen=True)
class Option:
    """A flag --NAME-IN-KEBAB-CASE, its variable PAGEDQ_NAME and the namespace attribute `name`."""

    name: str
    type: type
    default: object
    help: str
    choices: tuple[str, ...] | None = None
    bounds: dict[str, float] = field(default_factory=dict)  # pydantic's ge/gt/le/lt
    nullable: bool = False  # None allowed (the default means "unset")
    negatable: bool = False  # a bool as --x/--no-x; else --x sets True
    append: bool = False  # a list: the flag repeats, the variable is comma-separated
    many: bool = False  # with append: the flag also takes several values at once (vLLM's `--lora-modules a=x b=y`)
    pattern: str | None = None  # a str value (each, for a list) must match
    target: str | None = None  # the WorkerSettings field it fills, when its name differs

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


def queue_option(help: str = "queue name", default: str | None = "default", append: bool = False) -> Option:
    """--queue / PAGEDQ_QUEUE, with the queue-name rule of pagedq/worker/service/config.py."""
    return Option("queue", str, default, help, nullable=default is None, append=append, pattern=QUEUE_PATTERN)


def dataclass_options(cls: type) -> tuple[Option, ...]:
    """The fields of a settings dataclass whose metadata declares a flag (pagedq/worker/service/config.py's `_flag`)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name, spec = f.name, f.metadata.get("option")
        if spec is None:
            continue
        default = None if f.default is dataclasses.MISSING else f.default
        extra = {k: v for k, v in spec.items() if k not in ("help", "name")}
        nullable = type(None) in typing.get_args(hints[name]) or default is None
        hint = hints[name]
        if spec.get("append"):  # tuple[T, ...] | None: the flag's values are Ts
            hint = next(typing.get_args(a)[0] for a in typing.get_args(hint) if typing.get_origin(a) is tuple)
        out.append(
            Option(
                spec["name"] or name,
                value_type(hint),
                default,
                spec["help"],
                nullable=nullable,
                target=name,
                **extra,
            )
        )
    return tuple(out)


def engine_flag_options(exclude: Iterable[str] = ()) -> tuple[Option, ...]:
    """pagedq/engine/options.py's knobs as Options (EngineConfig validates their values when the engine is built)."""
    return tuple(
        Option(o.name, o.type, o.default, o.help, choices=o.choices, nullable=o.optional, negatable=o.negatable)
        for o in engine_options(exclude)
    )


def _split(value: object) -> object:
    return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value


def _annotation(opt: Option) -> object:
    if opt.append:
        item = Annotated[opt.type, StringConstraints(pattern=opt.pattern)] if opt.pattern else opt.type
        return Annotated[list[item] | None, NoDecode, BeforeValidator(_split)]  # type: ignore[valid-type]
    base: object = Literal[opt.choices] if opt.choices else opt.type
    return base | None if opt.nullable else base  # type: ignore[operator]


def settings_model(name: str, options: Sequence[Option]) -> type[BaseSettings]:
    """A pydantic-settings model with one field per option, reading PAGEDQ_<NAME>."""
    fields: dict[str, object] = {}
    for o in options:
        bounds: dict[str, float | None] = {"ge": None, "gt": None, "le": None, "lt": None, **o.bounds}
        pattern = None if o.append else o.pattern
        fields[o.name] = (
            _annotation(o),
            Field(
                default=o.default, ge=bounds["ge"], gt=bounds["gt"], le=bounds["le"], lt=bounds["lt"], pattern=pattern
            ),
        )
    config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")
    base = cast(type[BaseSettings], type(f"{name}Base", (BaseSettings,), {"model_config": config}))
    with warnings.catch_warnings():  # a flag named like a BaseModel method (--json): the field still wins on reads
        warnings.filterwarnings("ignore", message="Field name .* shadows an attribute", category=UserWarning)
        return create_model(name, __base__=base, **fields)  # type: ignore[call-overload]


def _help(opt: Option) -> str:
    shown = "" if opt.default is None or opt.default is False else f"default {opt.default}; "
    return f"{opt.help} ({shown}env {opt.env})".replace("%", "%%")


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Flags for `options`, resolved against the environment when `parser` (a SettingsParser) parses."""
    for opt in options:
        kwargs: dict[str, object] = {"dest": opt.name, "default": argparse.SUPPRESS, "help": _help(opt)}
        if opt.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if opt.negatable else "store_true"
        elif opt.append:
            kwargs["action"] = "append"
            if opt.many:
                kwargs.update(action="extend", nargs="+")
        else:  # pydantic converts and checks the value (choices too), so a flag and a variable fail the same way
            kwargs["metavar"] = "{" + ",".join(opt.choices) + "}" if opt.choices else opt.name.upper()
        parser.add_argument(opt.flag, **kwargs)  # type: ignore[arg-type]
    known = getattr(parser, "pagedq_options", ())
    parser.pagedq_options = (*known, *options)  # type: ignore[attr-defined]


class SettingsParser(StrictArgumentParser):
    """A pagedq parser whose commands' options fall back to PAGEDQ_* variables, then to their defaults, and are
    validated: a bad value exits 2 with one line naming the flag or the variable."""

    # argparse's stub declares overloads for a namespace type parameter; one plain signature serves here
    def parse_known_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        options: tuple[Option, ...] = getattr(self, "pagedq_options", ())
        if options:
            self._resolve(parsed, options)
        return parsed, extras

    def _resolve(self, parsed: argparse.Namespace, options: tuple[Option, ...]) -> None:
        model = settings_model("CommandSettings", options)
        given = {o.name: getattr(parsed, o.name) for o in options if hasattr(parsed, o.name)}
        try:
            values = model(**given)
        except ValidationError as error:
            by_name = {o.name: o for o in options}
            problems = []
            for item in error.errors():
                opt = by_name[str(item["loc"][0])]
                where = opt.flag if opt.name in given else opt.env
                problems.append(f"{where}={item.get('input')!r}: {item['msg']}")
            self.exit(2, f"{self.prog}: error: {'; '.join(problems)}\n")
        for o in options:
            setattr(parsed, o.name, getattr(values, o.name))
