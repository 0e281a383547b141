"""The list of calls of tool_choice "required", both ways: the JSON schema that forces it, and the calls read back
from what was generated. Pure: plain dicts and text, for every front door (chat, Batch API, `pagedq bulk`, and any
other that forces calls the same way).

The schema is vLLM's (`[{"name": ..., "parameters": {...}}, ...]`, one alternative per function), bounded: one call
under parallel_tool_calls false, else at most `max_calls`, since a small model may repeat a call until max_tokens.
A function whose parameters hold local references (`$defs`, `definitions`, a recursive `"#"`) has them moved under
the wrapper's root `$defs` (as `#/$defs/<function name>`), each reference rewritten to reach them there: inside the
wrapper "#" is the array, and xgrammar follows a pointer through object members only, never through `anyOf`'s list.

Reading takes the complete calls of a text as it grows (a stream's deltas, or a final text that max_tokens cut), in
order and each once: a call equal to an earlier one (same name and arguments) is dropped, and the cut tail of an
unfinished call is never returned.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}  # a function declared without parameters
DEFS = "$defs"
# Keywords whose values are data (a value to match or show), never schemas: a "$ref" in them is not a reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def call_list_schema(functions: dict[str, dict[str, Any]], max_calls: int) -> dict[str, Any]:
    """The schema of a list of 1..max_calls calls of these functions (name -> OpenAI function definition)."""
    alternatives, hoisted = [], {}
    for name, function in functions.items():
        parameters = function.get("parameters") or ANY_ARGUMENTS
        if _has_local_ref(parameters):  # under its function's name (a pointer-safe one: protocol/chat.py's rule)
            hoisted[name] = _rebased(parameters, f"#/{DEFS}/{name}")
            parameters = {"$ref": f"#/{DEFS}/{name}"}
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": max_calls, "items": {"anyOf": alternatives}}
    if hoisted:
        schema[DEFS] = hoisted
    return schema


def _subschemas(schema: Any) -> list[dict[str, Any]]:
    """Every object of a schema that may be a schema (data keywords' values left out), without recursion."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            found.append(node)
            stack.extend(value for key, value in node.items() if key not in _DATA_KEYWORDS)
    return found


def _has_local_ref(schema: Any) -> bool:
    return any(isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") for node in _subschemas(schema))


def _rebased(schema: Any, root: str) -> Any:
    """A copy of `schema` whose local references ("#...") point into it as it sits at `root`."""
    copy = json.loads(json.dumps(schema))
    for node in _subschemas(copy):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            node["$ref"] = root + ref[1:]
    return copy


_OUTSIDE_STRING = re.compile(r'[{}"]')
_INSIDE_STRING = re.compile(r'["\\]')


class CallListReader:
    """The complete calls of a generated call list, fed piece by piece: (name, arguments as JSON text) of each new
    call of a declared function, in order, repeats dropped. Linear in the text: it scans each character once and
    keeps only the call being read."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = frozenset(names)
        self.fed = 0  # characters fed so far
        self.calls: list[tuple[str, str]] = []
        self._pending = ""  # from the start of the call being read (or the scan position between calls)
        self._scan = 0  # where the scan resumes in _pending
        self._depth = 0
        self._in_string = False
        self._seen: set[tuple[str, str]] = set()

    def feed(self, piece: str) -> list[tuple[str, str]]:
        """The calls that `piece` completes."""
        self.fed += len(piece)
        text = self._pending = self._pending + piece
        pos, start, found = self._scan, 0, []
        while True:
            match = (_INSIDE_STRING if self._in_string else _OUTSIDE_STRING).search(text, pos)
            if match is None:
                pos = len(text)
                break
            char, pos = match.group(), match.end()
            if char == "\\":
                if pos == len(text):  # what it escapes has not come yet
                    pos -= 1
                    break
                pos += 1
            elif char == '"':
                self._in_string = not self._in_string
            elif char == "{":
                self._depth += 1
            elif self._depth > 0:
                self._depth -= 1
                if self._depth == 0:
                    found.extend(self._take(text[start:pos]))
                    start = pos
        if self._depth == 0:
            start = pos  # between calls: nothing before here is needed again
        self._pending, self._scan = text[start:], pos - start
        return found

    def _take(self, item: str) -> list[tuple[str, str]]:
        try:
            parsed = json.loads(item[item.index("{") :])  # the separators before it dropped
        except ValueError:
            return []
        found = _new_call(parsed, self.names, self._seen)
        if found is None:
            return []
        self.calls.append(found)
        return [found]


def _new_call(parsed: Any, names: frozenset[str], seen: set[tuple[str, str]]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a parsed list item that calls a declared function, unless `seen` holds it (it is
    added there)."""
    if not (isinstance(parsed, dict) and parsed.get("name") in names and isinstance(parsed.get("parameters"), dict)):
        return None
    key = (parsed["name"], json.dumps(parsed["parameters"], sort_keys=True))
    if key in seen:
        return None
    seen.add(key)
    return parsed["name"], json.dumps(parsed["parameters"], ensure_ascii=False)


_BETWEEN_CALLS = re.compile(r"[\s\[,]*")


def read_calls(text: str, names: Collection[str]) -> list[tuple[str, str]]:
    """The complete calls of a whole generated text, as CallListReader reads them, each item decoded in one pass of
    json's C decoder (a final text may be long: it is read on the gateway's event loop)."""
    decoder, declared, pos = json.JSONDecoder(), frozenset(names), 0
    seen: set[tuple[str, str]] = set()
    calls: list[tuple[str, str]] = []
    while True:
        separators = _BETWEEN_CALLS.match(text, pos)
        pos = separators.end() if separators else pos
        try:
            parsed, pos = decoder.raw_decode(text, pos)
        except ValueError:  # the list's end, or the cut
            return calls
        found = _new_call(parsed, declared, seen)
        if found is not None:
            calls.append(found)
