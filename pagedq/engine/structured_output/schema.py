"""What a JSON schema may not be, found up front without xgrammar: keywords xgrammar 0.2.8 cannot enforce (refused,
as vLLM does, never silently ignored, so a schema that compiles is one every output honours), nested too deep to
compile in good time (counted without recursion), or matched by no finite value (it would compile, then stall)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")

# Keywords whose value is itself a schema, a list of schemas, or a name -> schema map.
_SCHEMA_VALUED = ("items", "additionalProperties", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")

UNSUPPORTED_KEYWORDS = (
    "multipleOf",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "patternProperties",
    "propertyNames",
    "minProperties",
    "maxProperties",
    "dependentSchemas",
    "dependentRequired",
    "unevaluatedProperties",
    "unevaluatedItems",
    "not",
    "if",
    "then",
    "else",
)
# The string formats xgrammar builds a grammar for; any other format would be ignored, so it is refused.
SUPPORTED_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)


def unsupported_features(schema: object, path: str = "#") -> list[str]:
    """Every keyword of `schema` (and its subschemas) that xgrammar cannot enforce, as 'path: keyword'."""
    return list(_walk(schema, path))


def _walk(schema: object, path: str) -> Iterator[str]:
    if not isinstance(schema, dict):
        return  # true/false schemas and malformed parts: xgrammar itself judges those
    for keyword in UNSUPPORTED_KEYWORDS:
        if keyword in schema:
            yield f"{path}: {keyword}"
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS:
        yield f"{path}: format {fmt!r}"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        yield f"{path}: $ref {ref!r} (only local references)"
    for keyword in _SCHEMA_VALUED:
        if keyword in schema:
            yield from _walk(schema[keyword], f"{path}/{keyword}")
    for keyword in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(keyword) or ()):
            yield from _walk(sub, f"{path}/{keyword}/{i}")
    if isinstance(schema.get("items"), list):  # draft-4 tuple form
        for i, sub in enumerate(schema["items"]):
            yield from _walk(sub, f"{path}/items/{i}")
    for keyword in _SCHEMA_MAPS:
        value = schema.get(keyword)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield from _walk(sub, f"{path}/{keyword}/{name}")


def nesting_depth(value: object, cap: int | None = None) -> int:
    """JSON levels of objects and arrays in `value` (the schema object itself is level 1), counted without
    recursion: a schema nested thousands of levels deep must not exhaust the stack here either. With a `cap`, the
    count stops at cap + 1, so a Python object that contains itself ends the count too."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Iterable[object] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if cap is None or level <= cap:
            stack.extend((child, level + 1) for child in children)
    return deepest


def unmatchable(schema: dict[str, Any]) -> str | None:
    """The path of a subschema no finite JSON value matches (a `$ref` cycle with no way out, such as {"$ref": "#"},
    or a required part that is `false`), or None. xgrammar compiles such a schema, but its grammar allows no token
    once the output reaches that part, so the request could only fail mid-way; refused up front instead.

    Cautious: a keyword this does not model counts as matchable, so a schema is refused only when no value can match.
    The least fixed point of 'matchable' over the subschemas, by a worklist (each dependency wakes its dependents
    once), so a long chain of references costs its length, not its square."""
    nodes = dict(_subschemas(schema, "#"))  # id -> (subschema, path), in pre-order
    matchable: set[int] = set()
    dependents: dict[int, set[int]] = {}

    def holds(node: object, asker: int) -> bool:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict) or id(node) not in nodes:
            return True  # not a subschema this models: the converter judges it
        if id(node) not in matchable:
            dependents.setdefault(id(node), set()).add(asker)
            return False
        return True

    resolve = _resolver(schema)
    pending = list(nodes)
    while pending:
        key = pending.pop()
        if key in matchable:
            continue
        node = nodes[key][0]
        if _matches_something(node, resolve, partial(holds, asker=key)):
            matchable.add(key)
            pending.extend(dependents.pop(key, ()))
    for key, (node, path) in nodes.items():
        if key not in matchable and "$ref" in node:
            return f"{path} ($ref {node['$ref']!r} never reaches a value)"
    return next((path for key, (_, path) in nodes.items() if key not in matchable), None)


def _matches_something(node: dict[str, Any], resolve: Callable[[str], object], holds: Callable[[object], bool]) -> bool:
    """Whether some finite value matches `node`, given which of its subschemas do so far (`holds`)."""
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        return holds(resolve(ref))  # xgrammar follows the reference alone
    for keyword, combine in (("allOf", all), ("anyOf", any), ("oneOf", any)):
        subs = node.get(keyword)
        if isinstance(subs, list) and subs and not combine(holds(sub) for sub in subs):
            return False
    types = node.get("type")
    if types is None:
        return True
    return any(_type_has_a_value(node, kind, holds) for kind in (types if isinstance(types, list) else [types]))


def _type_has_a_value(node: dict[str, Any], kind: object, holds: Callable[[object], bool]) -> bool:
    if kind == "object":
        properties = _of_type(node, "properties", dict, {})
        extra = node.get("additionalProperties", True)
        required = _of_type(node, "required", list, [])
        return all(holds(properties.get(name, extra)) for name in required if isinstance(name, str))
    if kind == "array":
        at_least = _of_type(node, "minItems", int, 0)
        prefix = _of_type(node, "prefixItems", list, [])
        return all(holds(sub) for sub in prefix[:at_least]) and (
            at_least <= len(prefix) or holds(node.get("items", True))
        )
    return True


def _of_type(node: dict[str, Any], keyword: str, kind: type[T], default: T) -> T:
    """node[keyword] where it is of that kind, else the default (a malformed keyword is the converter's to judge)."""
    value = node.get(keyword)
    return value if isinstance(value, kind) else default


def _resolver(root: dict[str, Any]) -> Callable[[str], object]:
    """A local JSON pointer ('#', '#/$defs/a') to the subschema it names; None where it names nothing."""

    def resolve(ref: str) -> object:
        node: object = root
        for part in ref[1:].split("/")[1:] if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and part.isdecimal() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    return resolve


def _subschemas(schema: object, path: str) -> Iterator[tuple[int, tuple[dict[str, Any], str]]]:
    """Every object subschema (by id, with its path), in pre-order, without recursion."""
    stack = [(schema, path)]
    while stack:
        node, at = stack.pop()
        if not isinstance(node, dict):
            continue
        yield id(node), (node, at)
        children: list[tuple[object, str]] = [(node[k], f"{at}/{k}") for k in _SCHEMA_VALUED if k in node]
        for keyword in _SCHEMA_LISTS:
            if isinstance(node.get(keyword), list):
                children += [(sub, f"{at}/{keyword}/{i}") for i, sub in enumerate(node[keyword])]
        if isinstance(node.get("items"), list):  # draft-4 tuple form
            children += [(sub, f"{at}/items/{i}") for i, sub in enumerate(node["items"])]
        for keyword in _SCHEMA_MAPS:
            if isinstance(node.get(keyword), dict):
                children += [(sub, f"{at}/{keyword}/{name}") for name, sub in node[keyword].items()]
        stack.extend(reversed(children))
