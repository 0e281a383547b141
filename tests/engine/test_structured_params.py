"""StructuredOutputsParams: exactly one kind, each checked up front with an error naming the field, and the schema
keywords xgrammar cannot enforce refused (no model, no xgrammar needed)."""

from __future__ import annotations

import re

import pytest

from pagedq.engine import SamplingParams, StructuredOutputsParams
from pagedq.engine.structured_output.schema import unsupported_features


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of json, json_object, regex, choice, grammar, got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", ""]}, "choice must hold non-empty strings"),
        ({"choice": "ab"}, "choice must be a non-empty list"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"regex": 5}, "regex must be a non-empty string"),
        ({"grammar": "   "}, "grammar must be a non-empty EBNF string"),
        ({"json": "{not json"}, "json must be a JSON schema, not valid JSON"),
        ({"json": "[1, 2]"}, "json must be a JSON schema object, got list"),
        ({"json": 7}, "json must be a schema (a dict or JSON text)"),
        ({"json_object": "yes"}, "json_object must be True"),
        ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be a bool"),
        ({"regex": "a" * 70000}, "regex is 70000 characters"),
    ],
)
def test_bad_params_raise_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_unsupported_keywords_are_refused_wherever_they_nest():
    schema = {
        "type": "object",
        "properties": {
            # a property *named* like a keyword is fine; only keywords in schema position count
            "multipleOf": {"type": "integer", "multipleOf": 3},
            "tags": {"type": "array", "items": {"type": "string", "format": "color"}, "uniqueItems": True},
        },
        "$defs": {"x": {"anyOf": [{"type": "object", "minProperties": 1}]}},
    }
    assert unsupported_features(schema) == [
        "#/properties/multipleOf: multipleOf",
        "#/properties/tags: uniqueItems",
        "#/properties/tags/items: format 'color'",
        "#/$defs/x/anyOf/0: minProperties",
    ]
    with pytest.raises(ValueError, match="keywords the grammar cannot enforce: #/properties/multipleOf: multipleOf"):
        StructuredOutputsParams(json=schema)
    supported = {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}}
    assert StructuredOutputsParams(json=supported).schema == supported


def test_wire_form_round_trips_and_sampling_params_takes_a_dict():
    params = SamplingParams(structured_outputs={"json": '{"type": "object"}', "disable_any_whitespace": True})
    so = params.structured_outputs
    assert isinstance(so, StructuredOutputsParams) and so.kind == "json" and so.schema == {"type": "object"}
    assert StructuredOutputsParams.from_dict(so.to_dict()) == so
    assert so.spec() == StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True).spec()
    with pytest.raises(ValueError, match=r"unknown fields \['guided_json'\]"):
        StructuredOutputsParams.from_dict({"guided_json": {}})
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs=["regex"])  # type: ignore[arg-type]


def nested_items(depth: int) -> str:
    """A schema as text nested `depth` JSON levels deep (arrays of arrays ... of strings), 10 characters a level."""
    return '{"items":' * (depth - 1) + '{"type":"string"}' + "}" * (depth - 1)


@pytest.mark.abuse
@pytest.mark.parametrize("depth", [31, 940, 4000])
def test_a_schema_sent_as_text_is_bounded_in_depth_once_parsed(depth):
    """Brackets inside a JSON string escape the job's depth count: the parsed schema is counted itself, and one too
    deep for the parser (which would raise RecursionError) is refused just the same."""
    how = f"{depth} levels deep, more than the limit of 30" if depth < 1000 else "more than 30 levels deep"
    with pytest.raises(ValueError, match=re.escape(f"json schema is nested {how} (objects and arrays)")):
        StructuredOutputsParams(json=nested_items(depth))
    with pytest.raises(ValueError, match=re.escape("json schema is nested")):
        SamplingParams(structured_outputs={"json": nested_items(depth)})
    assert StructuredOutputsParams(json=nested_items(30)).schema is not None


@pytest.mark.abuse
def test_a_schema_given_as_a_dict_is_bounded_without_recursing():
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"items": schema}
    with pytest.raises(ValueError, match=re.escape("json schema is nested more than 30 levels deep")):
        StructuredOutputsParams(json=schema)
    loop: dict = {"type": "array"}
    loop["items"] = loop  # a Python schema that contains itself: the count stops, as serialising it would
    with pytest.raises(ValueError, match=re.escape("json schema is nested more than 30 levels deep")):
        StructuredOutputsParams(json=loop)


@pytest.mark.abuse
@pytest.mark.parametrize(
    "schema, where",
    [
        ({"$ref": "#"}, "# ($ref '#' never reaches a value)"),
        ({"anyOf": [{"$ref": "#"}]}, "#/anyOf/0 ($ref '#' never reaches a value)"),
        (
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
            "# ($ref '#/$defs/a' never reaches a value)",
        ),
        (
            {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
            "#/properties/next ($ref '#' never reaches a value)",
        ),
        (
            {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}},
            "#/properties/a ($ref '#/properties/a' never reaches a value)",
        ),
        ({"type": "object", "required": ["x"], "additionalProperties": False}, "#"),
    ],
)
def test_a_schema_no_finite_value_matches_is_refused_naming_where(schema, where):
    """xgrammar compiles {"$ref": "#"} into `root ::= root`, whose mask allows no token: refused up front."""
    with pytest.raises(ValueError, match=re.escape(f"json schema matches no finite JSON value: {where}") + "$"):
        StructuredOutputsParams(json=schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "items": {"$ref": "#"}},  # the empty array ends it
        {"anyOf": [{"$ref": "#"}, {"type": "integer"}]},
        {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]},
        {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {
            "$defs": {
                "tree": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}}}
            },
            "$ref": "#/$defs/tree",
        },
    ],
)
def test_recursive_schemas_with_a_way_out_pass(schema):
    assert StructuredOutputsParams(json=schema).schema == schema


def test_a_long_chain_of_references_is_followed_to_its_cycle():
    chain = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(1500)}  # 52 KB, under the 64 KB limit
    closed = {"$defs": {**chain, "a1500": {"$ref": "#/$defs/a0"}}, "$ref": "#/$defs/a0"}
    with pytest.raises(ValueError, match="matches no finite JSON value"):
        StructuredOutputsParams(json=closed)
