"""JSON-schema keywords xgrammar 0.2.8 cannot enforce: refused up front (vLLM does the same), never silently
ignored, so a schema that compiles is one every output honours."""

from __future__ import annotations

from collections.abc import Iterator

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
