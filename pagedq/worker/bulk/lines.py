"""The line format of `pagedq bulk` and the gateway's Batch API (OpenAI's batch files): a request line in, a job's
fields out; an output or error line for each finished job; which lines a previous run already answered.

A request line is the OpenAI Batch format (`{"custom_id", "method": "POST", "url", "body"}`) or a plain
`{"custom_id", "prompt" | "messages" | "prompt_token_ids", <job fields>}`. A body's `priority` is vLLM's (lower is
sooner), as the gateway reads the same body; a plain line's is the job field's (higher is sooner). Parsing raises
LineError, whose code is
what the errors file records. A chat body's tools, tool_choice and OpenAI-shaped conversation become the job's
fields as the gateway's chat endpoint makes them (pagedq/worker/protocol/tool_calls.py, the one implementation), and the
line's ToolSpec is what its output line's answer is parsed for (tool_calls, finish_reason "tool_calls").
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedq.worker.protocol import tool_calls
from pagedq.worker.protocol.chat import HERMES
from pagedq.worker.protocol.job import SAMPLING_FIELDS, from_vllm_priority
from pagedq.worker.protocol.tool_calls import RequestFieldError, ToolSpec

# model: the worker serves one model (model is echoed in the output), and a body's model naming a LoRA adapter runs
# the line under it (read_request's `adapters`); user: informational
OPENAI_IGNORED = {"model", "user"}
OPENAI_RENAMED = {"max_completion_tokens": "max_tokens"}
# What a line may set: the prompt (one of three forms), the job's sampling fields (protocol/job.py, the one list) and
# its scheduling fields. `n` is not among them: a bulk line is one completion.
JOB_FIELDS = {
    "prompt",
    "prompt_token_ids",
    "messages",
    "tools",  # a plain line's, as the job takes them (an OpenAI body's: from tools + tool_choice)
    "tool_call_parser",
    *(set(SAMPLING_FIELDS) - {"n"}),
    "priority",
    "deadline",
    "metadata",
    "tenant",  # who the line is for: tenants share the band (pagedq/worker/service/tenants.py)
    "lora",  # the LoRA adapter to run it under (an OpenAI body names it in `model`)
}


class LineError(ValueError):
    """One input line cannot become a job; code is the error code written to the errors file."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Request:
    """A parsed request line: its custom_id, the job's keywords, "chat" | "completion", the request's `model`
    (an OpenAI body's, echoed in the output; else None) and what its answer is parsed for (None: plain text)."""

    custom_id: str
    fields: dict[str, Any]
    kind: str
    model: str | None
    tools: ToolSpec | None


def parse_line(line: str) -> tuple[str, dict[str, Any], str]:
    """(custom_id, job keywords, "chat" | "completion"); LineError otherwise."""
    request = read_request(line)
    return request.custom_id, request.fields, request.kind


def parse_request(line: str) -> tuple[str, dict[str, Any], str, str | None]:
    """parse_line's answer and the request's `model` (an OpenAI body's, echoed in the output; else None)."""
    request = read_request(line)
    return request.custom_id, request.fields, request.kind, request.model


def read_request(
    line: str, max_tool_calls: int = tool_calls.DEFAULT_MAX_TOOL_CALLS, adapters: Collection[str] = ()
) -> Request:
    """The line as a Request; LineError otherwise. max_tool_calls bounds a tool_choice "required" list of calls.
    adapters: the LoRA adapters served on the queue (protocol/registry.py's adapter_names): an OpenAI body whose
    `model` names one runs under it, as the gateway's requests do; any other model is the served one."""
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise LineError("invalid_json", f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise LineError("invalid_json", "a line must be a JSON object")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", "custom_id (a non-empty string) is required")
    spec: ToolSpec | None = None
    if "body" in data:
        fields, spec = _openai_fields(data, max_tool_calls)
    else:
        fields = {k: v for k, v in data.items() if k != "custom_id"}
        if fields.get("tool_call_parser") == HERMES:  # a plain line asking for its calls parsed: "auto"
            spec = _spec(fields.get("tools"), None)
    model = data["body"].get("model") if "body" in data else None
    if isinstance(model, str) and model in adapters and "lora" not in fields:
        fields["lora"] = model
    unknown = sorted(set(fields) - JOB_FIELDS)
    if unknown:
        raise LineError("invalid_request", f"unsupported field(s): {', '.join(unknown)}")
    metadata = fields.get("metadata")
    fields["metadata"] = {**(metadata if isinstance(metadata, dict) else {}), "custom_id": custom_id}
    kind = "chat" if "messages" in fields else "completion"
    return Request(custom_id, fields, kind, model if isinstance(model, str) else None, spec)


def _spec(tools: Any, tool_choice: Any) -> ToolSpec | None:
    try:
        return tool_calls.tool_spec(tools, tool_choice)
    except RequestFieldError as error:
        raise LineError("invalid_request", str(error)) from None


def _openai_fields(data: dict[str, Any], max_tool_calls: int) -> tuple[dict[str, Any], ToolSpec | None]:
    """The job's keywords of an OpenAI body, and its ToolSpec."""
    body = data.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "body must be an object")
    if data.get("method", "POST") != "POST":
        raise LineError("invalid_request", f"method must be POST, got {data.get('method')!r}")
    url = data.get("url", "")
    if url and url not in ("/v1/completions", "/v1/chat/completions"):
        raise LineError("invalid_request", f"unsupported url {url!r} (use /v1/completions or /v1/chat/completions)")
    if body.get("n", 1) != 1 or body.get("stream", False):
        raise LineError("invalid_request", "n > 1 and stream are not supported in bulk runs")
    dropped = OPENAI_IGNORED | {"n", "stream"}
    fields: dict[str, Any] = {OPENAI_RENAMED.get(str(k), str(k)): v for k, v in body.items() if k not in dropped}
    prompt = fields.get("prompt")
    if isinstance(prompt, list):  # OpenAI allows a token list, or a list holding one prompt
        if prompt and all(isinstance(t, int) for t in prompt):
            fields["prompt_token_ids"] = fields.pop("prompt")
        elif len(prompt) == 1:
            fields["prompt"] = prompt[0]
        else:
            raise LineError("invalid_request", "one prompt per request line")
    if "messages" in fields:  # chat without max_tokens: the rest of the context (OpenAI's and vLLM's), not 16
        fields.setdefault("max_tokens", None)
    priority = fields.get("priority")
    if isinstance(priority, int) and not isinstance(priority, bool):  # anything else: the job refuses it, naming it
        fields["priority"] = from_vllm_priority(priority)
    if isinstance(fields.get("logprobs"), bool):  # chat: logprobs true + top_logprobs k
        top = fields.pop("top_logprobs", 0)
        fields["logprobs"] = top if fields["logprobs"] else None
    return fields, _tools_and_constraint(fields, max_tool_calls)


def _tools_and_constraint(fields: dict[str, Any], max_tool_calls: int) -> ToolSpec | None:
    """An OpenAI body's tools, tool_choice, conversation and output constraint as the job's fields, as the chat
    endpoint makes them (protocol/tool_calls.py); returns the ToolSpec its answer is parsed for."""
    tools, choice, parallel = (fields.pop(k, None) for k in ("tools", "tool_choice", "parallel_tool_calls"))
    spec = _spec(tools, choice)
    try:
        if "messages" in fields:  # OpenAI's conversation (arguments as JSON text) as the job's, as the gateway's
            fields.update(tool_calls.conversation_fields(fields["messages"], tools, spec.mode if spec else None))
        elif tools is not None:
            fields["tools"] = tools  # the job refuses tools without messages, naming them
        given = [("structured_outputs", fields.pop("structured_outputs"))] if "structured_outputs" in fields else []
        if "response_format" in fields:
            given += _response_format(fields.pop("response_format"))
        forced = tool_calls.tool_constraint(tools, choice, parallel, max_tool_calls) if spec else None
        chosen = tool_calls.one_constraint([*given, *([("tool_choice", forced)] if forced else [])])
    except RequestFieldError as error:
        raise LineError("invalid_request", str(error)) from None
    if chosen is not None:
        fields["structured_outputs"] = chosen[1]
    return spec


def _response_format(form: Any) -> list[tuple[str, Any]]:
    """OpenAI's response_format (json_object, json_schema) as a structured_outputs (the job validates it)."""
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", {"json_object": True})]
    if kind == "json_schema" and isinstance(form.get("json_schema"), dict) and "schema" in form["json_schema"]:
        return [("response_format", {"json": form["json_schema"]["schema"]})]
    raise LineError("invalid_request", "response_format must be text, json_object or json_schema with a schema")


def job_id_for(run_id: str, custom_id: str, input_digest: str = "") -> str:
    """The job id of a line: the run's namespace and a hash of its custom_id, and of the input's content hash when
    given (a run id chosen by hand is bound to its input, so reusing it on another input never meets its jobs)."""
    named = f"{input_digest}\0{custom_id}" if input_digest else custom_id
    return f"bulk.{run_id}.{hashlib.sha256(named.encode()).hexdigest()[:32]}"


JSON_WHITESPACE = " \t\r\n"


def split_lines(text: str) -> list[str]:
    """The lines of a JSONL text, split on "\\n" only (a "\\r" before it goes too). str.splitlines would also split
    on U+2028, U+0085 and \\x1c-\\x1e, which a JSON string may hold unescaped (json.dumps(ensure_ascii=False))."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def file_digest(path: Path) -> tuple[str, int]:
    """Content hash (the run's identity) and line count, in one pass; a last line without "\n" counts too."""
    h, lines, last = hashlib.sha256(), 0, b"\n"
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return h.hexdigest()[:16], lines + (last != b"\n")


# ---------------------------------------------------------------------------------------------- output lines
def output_line(
    custom_id: str,
    job_id: str,
    record: dict[str, Any],
    kind: str,
    body: dict[str, Any] | None = None,
    model: str | None = None,
    tools: ToolSpec | None = None,
) -> dict[str, Any]:
    """One output line; `body` replaces the response body built here (the gateway's Batch API passes its own).
    `model`: the request's, echoed as OpenAI's batch output does; `tools`: what a chat answer is parsed for (its
    message's tool_calls and content, and finish_reason, as the chat endpoint gives them)."""
    if body is not None:
        return {
            "id": f"batch_req_{job_id}",
            "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": job_id, "body": body},
            "error": None,
        }
    text, finish = record.get("text", ""), record.get("finish_reason")
    if kind == "chat":
        message = tools.message(text) if tools else {"role": "assistant", "content": text}
        finish = tools.finish_reason(text, finish) if tools else finish
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    usage = record.get("usage") or {}
    body = {
        "id": job_id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {**usage, "total_tokens": usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)},
        "pagedq": {k: record.get(k) for k in ("status", "stop_reason", "timings", "worker", "attempts", "error")},
    }
    if record.get("prompt_logprobs") is not None:
        body["pagedq"]["prompt_logprobs"] = record["prompt_logprobs"]
    return {
        "id": f"batch_req_{job_id}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": job_id, "body": body},
        "error": None,
    }


def error_line(
    custom_id: str | None,
    line_no: int,
    code: str,
    message: str,
    job_id: str | None = None,
    record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    response = None
    if record is not None:
        response = {
            "status_code": 400 if record.get("status") == "rejected" else 500,
            "request_id": job_id,
            "body": record,
        }
    # A line that never became a job has no job id: its row is named after its line (unique in the file).
    return {
        "id": f"batch_req_{job_id}" if job_id else f"batch_req_line_{line_no}",
        "custom_id": custom_id,
        "line": line_no,
        "response": response,
        "error": {"code": code, "message": message},
    }


def custom_id_of(text: str, exc: LineError) -> str | None:
    """The custom_id of a line that failed after it was read (so a resume skips it); None for bad JSON."""
    if exc.code in ("invalid_json", "missing_custom_id"):
        return None
    try:
        return json.loads(text).get("custom_id")
    except ValueError:
        return None
