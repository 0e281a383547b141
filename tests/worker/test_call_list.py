"""The list of calls of tool_choice "required" (pagedq/worker/protocol/call_list.py): its schema, judged by the
jsonschema library against the functions' own parameters, and the reading of generated text in any pieces."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from pagedq.worker.protocol.call_list import CallListReader, call_list_schema, read_calls
from pagedq.worker.protocol.tool_calls import tool_constraint

TRICKY = {"note": 'braces } { and "quotes" \\ in a string', "n": [1, {"deep": True}]}
LIST = json.dumps(
    [
        {"name": "a", "parameters": TRICKY},
        {"name": "a", "parameters": {"n": [1, {"deep": True}], "note": TRICKY["note"]}},  # the same, reordered
        {"name": "undeclared", "parameters": {}},
        {"name": "b", "parameters": {"x": "é"}},
        {"name": "a", "parameters": TRICKY},
    ],
    ensure_ascii=False,
)
CALLS = [("a", json.dumps(TRICKY, ensure_ascii=False)), ("b", '{"x": "é"}')]


@pytest.mark.parametrize("seed", range(4))
def test_the_calls_read_in_any_pieces_are_the_complete_ones_each_once(seed):
    cut = LIST[: LIST.rindex('{"name": "b"') + 30]  # max_tokens cut inside the call of b
    assert read_calls(LIST, {"a", "b"}) == CALLS and read_calls(cut, {"a", "b"}) == CALLS[:1]
    rng, reader, found, pos = random.Random(seed), CallListReader({"a", "b"}), [], 0
    while pos < len(LIST):
        step = rng.choice([1, 1, 2, 3, 7, 40])
        found += reader.feed(LIST[pos : pos + step])
        pos += step
    assert found == reader.calls == CALLS and reader.fed == len(LIST)
    assert [json.loads(arguments) for _, arguments in found] == [TRICKY, {"x": "é"}]


def test_the_schema_bounds_the_list_and_keeps_each_functions_references():
    unit = {"enum": ["celsius", "fahrenheit"]}
    tree = {
        "type": "object",
        "properties": {
            "unit": {"$ref": "#/$defs/unit"},
            "children": {"type": "array", "items": {"$ref": "#"}},
            "example": {"const": {"$ref": "#/not/a/reference"}},  # data: left as written
        },
        "required": ["unit"],
        "additionalProperties": False,
        "$defs": {"unit": unit},
    }
    flat = {"type": "object", "properties": {"z": {"type": "integer"}}, "required": ["z"]}
    functions = {"tree": {"name": "tree", "parameters": tree}, "flat": {"name": "flat", "parameters": flat}}
    schema = call_list_schema(functions, 2)
    assert schema["maxItems"] == 2 and set(schema["$defs"]) == {"tree"}  # flat has no references: inline
    assert schema["$defs"]["tree"]["properties"]["example"] == {"const": {"$ref": "#/not/a/reference"}}
    nested = {"unit": "celsius", "children": [{"unit": "fahrenheit", "example": {"$ref": "#/not/a/reference"}}]}
    good = [{"name": "tree", "parameters": nested}, {"name": "flat", "parameters": {"z": 1}}]
    jsonschema.validate(nested, tree)  # the oracle: what the client's own schema takes, the list takes
    jsonschema.validate(good, schema)
    for bad in (
        [{"name": "tree", "parameters": {"unit": "kelvin"}}],
        [{"name": "tree", "parameters": {"unit": "celsius", "children": [{"unit": "kelvin"}]}}],
        [{"name": "flat", "parameters": {"z": 1}}] * 3,  # more than max_calls
        [],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    tools = [{"type": "function", "function": function} for function in functions.values()]
    assert tool_constraint(tools, "required", False, 16)["json"]["maxItems"] == 1
    assert tool_constraint(tools, "required", None, 16)["json"]["maxItems"] == 16
