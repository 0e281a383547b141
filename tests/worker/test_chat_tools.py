"""Chat jobs with tools: the worker renders them as transformers' apply_chat_template(messages, tools=...) does
where the checkpoint's template declares tools (the oracle: transformers itself on the same tokenizer), in the
Hermes form where it does not, and refuses Hermes parsing of answers a tools template writes in its own format.
Bad tools and tool messages are rejected at submit, naming the field."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from pagedq.worker.protocol.chat import template_declares_tools
from pagedq.worker.protocol.errors import JobRejected
from pagedq.worker.protocol.job import build_job, parse_job
from pagedq.worker.service.engine_input import engine_prompt

# Qwen2.5's tool section, cut down: the tools in the system turn, calls as <tool_call> JSON, results in user turns
HERMES_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant{% if message.content %}\n{{ message.content }}"
    "{% endif %}{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
# A template that declares tools but writes calls as bare JSON (Llama 3.1's way): not Hermes
OWN_FORMAT_TEMPLATE = (
    "{% if tools %}Functions: {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: "
    "{% if m.tool_calls %}{{ m.tool_calls[0].function | tojson }}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}<s>assistant:"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What time is it in UTC?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "utc"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
]


def engine_with(tiny_llama_dir, template: str) -> SimpleNamespace:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tokenizer.chat_template = template
    return SimpleNamespace(tokenizer=tokenizer)


def test_a_tools_template_renders_as_transformers_does(tiny_llama_dir):
    engine = engine_with(tiny_llama_dir, HERMES_TOOLS_TEMPLATE)
    job = parse_job(build_job(messages=CONVERSATION, tools=TOOLS, tool_call_parser="hermes").to_json())
    expected = engine.tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "<tools>" in expected and '"arguments": {"zone": "utc"}' in expected and "12:00" in expected
    assert engine_prompt(engine, job) == engine.tokenizer.encode(expected, add_special_tokens=False)


def test_a_template_without_tools_gets_the_hermes_form(tiny_llama_dir):
    engine = engine_with(tiny_llama_dir, PLAIN_TEMPLATE)
    job = build_job(messages=CONVERSATION, tools=TOOLS, tool_call_parser="hermes")
    text = engine.tokenizer.decode(engine_prompt(engine, job))
    listed = text[text.index("<tools>\n") + len("<tools>\n") : text.index("\n</tools>")]
    assert [json.loads(line) for line in listed.splitlines()] == TOOLS
    assert text.startswith("<s>system: You are terse.\n\nYou may call one or more functions")
    assert '<s>assistant: <tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call></s>' in text
    assert "<s>user: <tool_response>\n12:00\n</tool_response></s><s>assistant:" in text
    # a plain conversation renders exactly as before: the template given {role, content} turns
    plain = build_job(messages=CONVERSATION[:2])
    turns = [{"role": m["role"], "content": m["content"]} for m in CONVERSATION[:2]]
    expected = engine.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert engine_prompt(engine, plain) == engine.tokenizer.encode(expected, add_special_tokens=False)


def test_hermes_parsing_is_refused_where_the_template_writes_its_own_calls(tiny_llama_dir):
    engine = engine_with(tiny_llama_dir, OWN_FORMAT_TEMPLATE)
    with pytest.raises(ValueError, match="not as Hermes <tool_call> blocks"):
        engine_prompt(engine, build_job(messages=CONVERSATION, tools=TOOLS, tool_call_parser="hermes"))
    forced = build_job(messages=CONVERSATION, tools=TOOLS)  # required / named: the output is a JSON constraint
    expected = engine.tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert engine_prompt(engine, forced) == engine.tokenizer.encode(expected, add_special_tokens=False)


def test_which_templates_declare_tools():
    assert template_declares_tools(HERMES_TOOLS_TEMPLATE) and template_declares_tools(OWN_FORMAT_TEMPLATE)
    assert not template_declares_tools(PLAIN_TEMPLATE)
    assert not template_declares_tools("{% set tools = [] %}{{ tools }} tools {{ messages }}")


def _call(**function):
    return {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": function}]}


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
        ({"tools": [TOOLS[0]] * 129}, "tools: List should have at most 128"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": "x" * 300_000}}}]}, "bytes"),
        ({"messages": [{"role": "tool", "content": "12:00"}]}, "needs a tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "needs a tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "needs content"),
        ({"messages": [{**_call(name="f", arguments={}), "role": "user"}]}, "tool_calls belong to assistant"),
        ({"messages": [_call(name="f", arguments="{}")]}, "messages.0.tool_calls.0.function.arguments"),
        ({"messages": [_call(name="f", arguments={"a": 1}, extra=1)]}, "messages.0.tool_calls.0.function.extra"),
        ({"prompt": "x", "messages": None, "tools": TOOLS}, "tools and tool_call_parser go with messages"),
        ({"tool_call_parser": "mistral"}, "tool_call_parser"),
    ],
)
def test_bad_tools_and_tool_messages_are_rejected_naming_the_field(fields, words):
    with pytest.raises(JobRejected, match=words):
        build_job(**{"messages": CONVERSATION[1:2], **fields})


def test_a_plain_chat_job_serialises_without_the_tool_fields():
    wire = json.loads(build_job(messages=CONVERSATION[:2]).to_json())
    assert "tools" not in wire and "tool_call_parser" not in wire
    assert wire["messages"] == [{"role": m["role"], "content": m["content"]} for m in CONVERSATION[:2]]
