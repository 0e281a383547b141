"""Hostile schemas at the gateway (issue 34, findings 5 and 17): a schema sent as text is bounded in depth once
parsed (the brackets inside a JSON string escape the body's own depth count), one too deep for the parser is a 400
rather than a RecursionError, and a `$ref` cycle no value can end is a 400 at validation, not a job that fails.
Oracles: the openai SDK's BadRequestError, and raw HTTP for OpenAI's error shape."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from .conftest import served_model

pytestmark = pytest.mark.abuse
ASK = [{"role": "user", "content": "Answer with JSON."}]


@pytest.fixture(scope="module")
def served(chat_llama_dir):
    with served_model(chat_llama_dir) as stack:
        yield stack


def nested_items(depth: int) -> str:
    """A schema as text nested `depth` JSON levels deep, 10 characters a level (940 levels: about 10 KB)."""
    return '{"items":' * (depth - 1) + '{"type":"string"}' + "}" * (depth - 1)


def json_schema(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


CYCLE = {"$ref": "#"}
CYCLE_WORDS = "json schema matches no finite JSON value: # ($ref '#' never reaches a value)"


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"extra_body": {"structured_outputs": {"json": nested_items(940)}}}, "nested 940 levels deep"),
        (
            {"response_format": json_schema(json.loads(nested_items(40)))},
            "response_format: json schema is nested more than 30",
        ),
        ({"extra_body": {"structured_outputs": {"json": CYCLE}}}, CYCLE_WORDS),
        ({"response_format": json_schema(CYCLE)}, CYCLE_WORDS),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": CYCLE}}],
                "tool_choice": "required",
            },
            "($ref '#/$defs/f' never reaches a value)",  # f's parameters, moved under the list's $defs
        ),
        # what only xgrammar's converter refuses: the worker's compile, a 400 with its message (no log prefix)
        ({"response_format": json_schema({"type": "strin"})}, 'json does not compile: Unsupported type "strin"'),
    ],
)
def test_deep_and_endless_schemas_are_400_naming_the_problem(served, extra, words):
    with pytest.raises(openai.BadRequestError, match=re.escape(words)):
        served.sdk.chat.completions.create(model=served.model, messages=ASK, max_tokens=4, **extra)


def test_a_schema_too_deep_for_the_parser_is_a_400_in_openais_shape(served):
    """4,000 levels as text: json.loads would raise RecursionError (a plain 500 before)."""
    body = {"model": served.model, "messages": ASK, "structured_outputs": {"json": nested_items(4000)}}
    response = httpx.post(f"{served.base}/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "json schema is nested more than 30 levels deep" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_recursive_schema_with_a_way_out_still_runs(served):
    tree = {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}
    out = served.sdk.chat.completions.create(
        model=served.model, messages=ASK, max_tokens=16, response_format=json_schema(tree)
    )
    assert out.choices[0].finish_reason in ("stop", "length")
