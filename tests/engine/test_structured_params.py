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
