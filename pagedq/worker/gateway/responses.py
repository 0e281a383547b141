"""POST /v1/responses: OpenAI's Responses API, stateless. A Responses body is the chat request it means
(responses_request.py), served by the chat endpoint's machinery (the same jobs, tools, constraints, limits and
backpressure through Gateway.generate); only the answer's shape differs. A chat answer becomes output items: a
`message` with its `output_text`, and one `function_call` item per tool call. A stream's chat chunks become the
Responses' typed events (each `event:` named, with a sequence_number), as the SDK's `responses.stream` reads them:
response.created, response.in_progress, per item output_item.added, content_part.added, output_text.delta (or
function_call_arguments.delta), their .done events and output_item.done, then response.completed (or
response.incomplete, when max_output_tokens cut the answer).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response

from pagedq.worker.gateway.chat import ChatEndpoint
from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.gateway.intake import parse_body
from pagedq.worker.gateway.render import now, usage
from pagedq.worker.gateway.responses_request import ResponsesRequest, chat_request
from pagedq.worker.protocol.job import FinalRecord

STATELESS = "this gateway is stateless: responses are not stored (store is accepted and ignored)"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(records: list[FinalRecord]) -> dict[str, Any]:
    counted = usage(records)
    return {
        "input_tokens": counted["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": counted["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": counted["total_tokens"],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    function = call["function"]
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": status,
    }


class ResponsesEndpoint(ChatEndpoint):
    object_name = "response"
    id_prefix = "resp_"
    prompt_param = "input"

    def __init__(self, body: ResponsesRequest, created: int) -> None:
        chat = chat_request(body)
        super().__init__(chat, chat.model, created)
        self.responses_body = body
        # streaming: events sent (the next sequence_number), output items, the open one (its index), the finish reason
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open_item: int | None = None
        self.finish_reason: str | None = None

    def response_object(
        self, response_id: str, status: str, output: list[dict[str, Any]], records: list[FinalRecord] | None
    ) -> dict[str, Any]:
        body = self.responses_body
        choice = body.tool_choice
        return {
            "id": self.id_prefix + response_id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": choice.model_dump()
            if choice is not None and not isinstance(choice, str)
            else choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
            if body.text is not None and body.text.format is not None
            else {"format": {"type": "text"}},
            "store": False,  # nothing is stored, whatever the request said
            "previous_response_id": None,
            "truncation": "disabled",
            "user": body.user,
            "usage": response_usage(records) if records is not None else None,
        }

    def response(self, records: list[FinalRecord]) -> dict[str, Any]:
        (choice,) = super().response(records)["choices"]
        message, status = choice["message"], _status(choice["finish_reason"])
        output = []
        if message.get("content") or not message.get("tool_calls"):
            output.append(_message_item(_item_id("msg"), message.get("content") or "", status))
        output += [_call_item(_item_id("fc"), call, "completed") for call in message.get("tool_calls") or ()]
        return self.response_object(records[0].id, status, output, records)

    # --- streaming: each chat chunk (opening, delta_chunk, closing: ChatEndpoint's) as the typed events it means
    def frame(self, chunk: dict[str, Any], include_usage: bool) -> bytes:
        events: list[dict[str, Any]] = []
        if self.sequence == 0:
            created = self.response_object(chunk["id"].removeprefix(self.id_prefix), "in_progress", [], None)
            events += [
                {"type": "response.created", "response": created},
                {"type": "response.in_progress", "response": created},
            ]
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                if "id" in call:  # a new call: the item before it is done
                    events += self._close_item("completed")
                    opened = _call_item(_item_id("fc"), call, "in_progress") | {"arguments": ""}  # deltas follow
                    events += self._open_item(opened)
                if call["function"].get("arguments"):
                    events += self._arguments_delta(call["function"]["arguments"])
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return self._encode(events)

    def ending(self, response_id: str, records: list[FinalRecord], include_usage: bool) -> bytes:
        status = _status(self.finish_reason)
        events = self._close_item(status)
        final = self.response_object(response_id, status, self.items, records)
        events.append(
            {"type": "response.completed" if status == "completed" else "response.incomplete", "response": final}
        )
        return self._encode(events)

    def failure(self, error: OpenAIError) -> bytes:
        body = error.body()["error"]
        return self._encode(
            [{"type": "error", "code": body["code"], "message": body["message"], "param": body["param"]}]
        )

    def _encode(self, events: list[dict[str, Any]]) -> bytes:
        framed = []
        for payload in events:
            payload["sequence_number"] = self.sequence
            self.sequence += 1
            data = json.dumps(payload, separators=(",", ":"))
            framed.append(f"event: {payload['type']}\ndata: {data}\n\n".encode())
        return b"".join(framed)

    def _open_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.open_item = len(self.items)
        self.items.append(item)
        events = [
            {
                "type": "response.output_item.added",
                "output_index": self.open_item,
                "item": dict(item, content=[]) if item["type"] == "message" else dict(item),
            }
        ]
        if item["type"] == "message":
            events.append(
                {**self._where(), "type": "response.content_part.added", "content_index": 0, "part": _text_part("")}
            )
        return events

    def _where(self) -> dict[str, Any]:
        assert self.open_item is not None
        return {"item_id": self.items[self.open_item]["id"], "output_index": self.open_item}

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open_item is None or self.items[self.open_item]["type"] != "message":
            events += self._close_item("completed")
            events += self._open_item(_message_item(_item_id("msg"), "", "in_progress"))
        assert self.open_item is not None
        self.items[self.open_item]["content"][0]["text"] += text
        events.append(
            {**self._where(), "type": "response.output_text.delta", "content_index": 0, "delta": text, "logprobs": []}
        )
        return events

    def _arguments_delta(self, text: str) -> list[dict[str, Any]]:
        assert self.open_item is not None
        self.items[self.open_item]["arguments"] += text
        return [{**self._where(), "type": "response.function_call_arguments.delta", "delta": text}]

    def _close_item(self, status: str) -> list[dict[str, Any]]:
        if self.open_item is None:
            return []
        item, where = self.items[self.open_item], self._where()
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [
                {
                    **where,
                    "type": "response.output_text.done",
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": [],
                },
                {**where, "type": "response.content_part.done", "content_index": 0, "part": part},
            ]
        else:
            events = [
                {
                    **where,
                    "type": "response.function_call_arguments.done",
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            ]
        events.append({"type": "response.output_item.done", "output_index": self.open_item, "item": item})
        self.open_item = None
        return events


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def router(generate: Callable[[ChatEndpoint, Request], Awaitable[Response]], auth: Any) -> APIRouter:
    """POST /v1/responses; a stored response (GET, DELETE /v1/responses/{id}) is a 400: nothing is stored."""
    routes = APIRouter(dependencies=[auth])

    @routes.post("/v1/responses")
    async def create(request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest)
        return await generate(ResponsesEndpoint(body, now()), request)

    @routes.get("/v1/responses/{response_id}")
    @routes.delete("/v1/responses/{response_id}")
    async def stored(response_id: str) -> Response:
        raise OpenAIError(400, f"response {response_id[:64]!r} cannot be retrieved: {STATELESS}", param="response_id")

    return routes
