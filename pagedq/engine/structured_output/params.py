"""StructuredOutputsParams: vLLM's names (vllm.sampling_params.StructuredOutputsParams), checked on construction
without xgrammar, so producers (the queue client, the gateway) refuse a bad constraint before it is queued."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, field
from typing import Any

from pagedq.engine import limits
from pagedq.engine.errors import RequestRejected
from pagedq.engine.structured_output.schema import nesting_depth, unmatchable, unsupported_features

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Exactly one of json (a schema, dict or JSON text), json_object=True, regex, choice (strings) or grammar
    (EBNF); disable_any_whitespace emits JSON without optional whitespace (else runs of it are bounded)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # Whom its compile is charged to: an opaque key (the worker sets the job's tenant) whose compiles share the
    # compile threads with other keys' (compiler.py). Not on the wire: a producer cannot choose it.
    compile_source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise RequestRejected(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}, got {', '.join(given) or 'none'}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise RequestRejected(f"disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}")
        if not isinstance(self.compile_source, str):
            raise RequestRejected(f"compile_source must be a string, got {type(self.compile_source).__name__}")
        getattr(self, f"_check_{given[0]}")()

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def schema(self) -> dict[str, Any] | None:
        """The json schema as a dict (None for the other kinds)."""
        if self.json is None:
            return None
        return jsonlib.loads(self.json) if isinstance(self.json, str) else self.json

    def spec(self) -> tuple[str, str]:
        """(kind, canonical text): what a compiled grammar is keyed by."""
        kind = self.kind
        if kind == "json":
            return kind, jsonlib.dumps(self.schema, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, jsonlib.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, str(getattr(self, kind))

    def to_dict(self) -> dict[str, Any]:
        """The wire form: only the fields that are set."""
        out: dict[str, Any] = {self.kind: getattr(self, self.kind)}
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out

    def _check_json(self) -> None:
        if isinstance(self.json, str):
            _check_size("json", self.json)
            try:
                schema = jsonlib.loads(self.json)
            except jsonlib.JSONDecodeError as error:
                raise RequestRejected(f"json must be a JSON schema, not valid JSON: {error}") from None
            except RecursionError:  # the parser's own limit, far past ours: the text is nested too deep
                raise RequestRejected(_too_deep(None)) from None
            _check_depth(schema, exact=True)  # parsed JSON: no cycles, and no deeper than the parser goes
        elif isinstance(self.json, dict):
            schema = self.json
            # first: serialising a schema nested thousands deep would recurse (and a dict may contain itself)
            _check_depth(schema, exact=False)
            try:
                text = jsonlib.dumps(schema)
            except (TypeError, ValueError) as error:
                raise RequestRejected(f"json must be a JSON-serialisable schema: {error}") from None
            _check_size("json", text)
        else:
            raise RequestRejected(f"json must be a schema (a dict or JSON text), got {type(self.json).__name__}")
        if not isinstance(schema, dict):
            raise RequestRejected(f"json must be a JSON schema object, got {type(schema).__name__}")
        unsupported = unsupported_features(schema)
        if unsupported:
            raise RequestRejected(f"json schema uses keywords the grammar cannot enforce: {', '.join(unsupported[:5])}")
        empty_at = unmatchable(schema)
        if empty_at is not None:
            raise RequestRejected(f"json schema matches no finite JSON value: {empty_at}")

    def _check_json_object(self) -> None:
        if self.json_object is not True:
            raise RequestRejected(f"json_object must be True when given, got {self.json_object!r}")

    def _check_regex(self) -> None:
        if not isinstance(self.regex, str) or not self.regex:
            raise RequestRejected(f"regex must be a non-empty string, got {self.regex!r}")
        _check_size("regex", self.regex)

    def _check_grammar(self) -> None:
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise RequestRejected(f"grammar must be a non-empty EBNF string, got {self.grammar!r}")
        _check_size("grammar", self.grammar)

    def _check_choice(self) -> None:
        choice = self.choice
        if not isinstance(choice, (list, tuple)) or not choice:
            raise RequestRejected(f"choice must be a non-empty list of strings, got {choice!r}")
        if not all(isinstance(c, str) and c for c in choice):
            raise RequestRejected("choice must hold non-empty strings")
        self.choice = list(choice)
        _check_size("choice", jsonlib.dumps(self.choice))

    @classmethod
    def from_dict(cls, data: object) -> StructuredOutputsParams:
        """From the wire form (a job's or an HTTP body's `structured_outputs`); RequestRejected naming the field."""
        if isinstance(data, StructuredOutputsParams):
            return data
        if not isinstance(data, dict):
            raise RequestRejected(f"structured_outputs must be an object, got {type(data).__name__}")
        known = {*KINDS, "disable_any_whitespace"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RequestRejected(f"structured_outputs has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**data)


def _check_depth(schema: object, exact: bool) -> None:
    """Refuse a schema nested past the limit, naming its depth when `exact` (else counting stops past the limit)."""
    limit = limits.STRUCTURED_SCHEMA_MAX_DEPTH
    depth = nesting_depth(schema, cap=None if exact else limit)
    if depth > limit:
        raise RequestRejected(_too_deep(depth if exact else None))


def _too_deep(depth: int | None) -> str:
    limit = limits.STRUCTURED_SCHEMA_MAX_DEPTH
    how = f"{depth} levels deep, more than the limit of {limit}" if depth else f"more than {limit} levels deep"
    return f"json schema is nested {how} (objects and arrays)"


def _check_size(name: str, text: str) -> None:
    if len(text) > limits.STRUCTURED_SPEC_MAX_CHARS:
        raise RequestRejected(f"{name} is {len(text)} characters; at most {limits.STRUCTURED_SPEC_MAX_CHARS}")
