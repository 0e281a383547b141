"""POST /v1/chat/completions: messages as a chat job (the worker applies the model's chat template)."""

from __future__ import annotations

from typing import Any

from pagedq.worker.gateway.completions import CompletionEndpoint
from pagedq.worker.gateway.jobs import sampling_fields
from pagedq.worker.gateway.render import TokenNames, chat_logprobs, choices_of, usage
from pagedq.worker.gateway.schemas import ChatCompletionRequest
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.gateway.tools import TOOL_CALL_OPEN, conversation_fields, tool_spec
from pagedq.worker.protocol.call_list import CallListReader
from pagedq.worker.protocol.job import Delta, FinalRecord
from pagedq.worker.protocol.tool_calls import ToolSpec, call, new_call_id


class ChatEndpoint(CompletionEndpoint):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    prompt_param = "messages"

    def __init__(
        self,
        body: ChatCompletionRequest | None,
        model: str,
        created: int,
        k: int | None = None,
        tools: ToolSpec | None = None,
    ) -> None:
        """`k` and `tools` stand for the body's where there is none (the Batch API answers from a line's)."""
        self.body, self.model, self.created = body, model, created
        self.k = ((body.top_logprobs or 0) if body.logprobs else None) if body is not None else k
        self.as_ids = bool(body and body.return_tokens_as_token_ids)
        self.n = body.n if body is not None else 1
        # "named" / "required": the output is a tool call (its arguments, or a list of calls), returned as tool_calls;
        # "auto": text that may hold calls (protocol/tool_calls.py), streamed as content up to the first call
        self.spec = tool_spec(body) if body is not None else tools
        self.tools = self.spec.mode if self.spec is not None else None
        self.call_ids = [new_call_id() for _ in range(self.n)] if self.tools == "named" else []
        self.streamed: dict[int, str] = {}  # auto, streaming: each choice's text so far
        self.sent: dict[int, int] = {}  # and how much of it went out as content
        self.call_lists: dict[int, CallListReader] = {}  # required, streaming: each choice's calls read so far

    def chat_body(self) -> ChatCompletionRequest:
        body = self.request_body()
        if not isinstance(body, ChatCompletionRequest):
            raise TypeError(f"a chat endpoint got a {type(body).__name__}")
        return body

    def jobs_fields(self, settings: GatewaySettings) -> list[dict[str, Any]]:
        body = self.chat_body()
        asked = body.max_completion_tokens or body.max_tokens
        fields = sampling_fields(body, settings, asked or settings.default_chat_max_tokens)
        fields.update(conversation_fields(body, self.tools))
        if self.k is not None:
            fields["logprobs"] = self.k
        return [fields]

    def _chat_logprobs(self, token_ids: list[int], entries: list | None, texts: dict[str, str] | None) -> dict | None:
        if self.k is None:
            return None
        return chat_logprobs(token_ids, entries or [], self.k, TokenNames(texts, self.as_ids))

    def response(self, records: list[FinalRecord]) -> dict[str, Any]:
        (record,) = records
        choices = [
            {
                "index": c.index,
                "message": self._message(c.text),
                "finish_reason": self._finish_reason(c.text, c.finish_reason),
                "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, record.token_texts),
                "stop_reason": c.stop_reason,
            }
            for c in choices_of(record)
        ]
        return self.envelope(record.id, choices, usage=usage(records))

    def _message(self, text: str) -> dict[str, Any]:
        message = self.spec.message(text) if self.spec is not None else {"role": "assistant", "content": text}
        return {**message, "refusal": None}

    def _finish_reason(self, text: str, reason: str | None) -> str | None:
        return self.spec.finish_reason(text, reason) if self.spec is not None else reason

    # --- streaming: object "chat.completion.chunk"; the first chunk of each choice names the role
    def chunk(self, job_id: str, choices: list[dict]) -> dict[str, Any]:
        return {**self.envelope(job_id, choices), "object": self.chunk_object}

    def opening(self, job_id: str) -> list[dict[str, Any]]:
        def first(i: int) -> dict[str, Any]:
            if self.tools == "named":  # the call's id and name first; its arguments stream as they are generated
                assert self.spec is not None and self.spec.named is not None
                opened = {**call(self.spec.named, "", self.call_ids[i]), "index": 0}
                return {"role": "assistant", "content": None, "tool_calls": [opened]}
            return {"role": "assistant", "content": None if self.tools else ""}

        choices = [
            {"index": i, "delta": first(i), "logprobs": None, "finish_reason": None}
            for i in range(self.request_body().n)
        ]
        return [self.chunk(job_id, choices)]

    def delta_chunk(self, response_id: str, prompt_index: int, delta: Delta) -> dict[str, Any] | None:
        lps = self._chat_logprobs(delta.token_ids, delta.logprobs, delta.token_texts)
        if self.tools == "required":
            return self._calls_chunk(response_id, delta.index, delta.text)
        if self.tools == "auto":
            return self._auto_delta(response_id, delta, lps)
        content = (
            {"tool_calls": [{"index": 0, "function": {"arguments": delta.text}}]}
            if self.tools == "named"
            else {"content": delta.text}
        )
        return self.chunk(
            response_id, [{"index": delta.index, "delta": content, "logprobs": lps, "finish_reason": None}]
        )

    def _auto_delta(self, response_id: str, delta: Delta, lps: dict | None) -> dict[str, Any] | None:
        """Content as it comes, held back from where a <tool_call> may begin (its calls are sent at the close)."""
        text = self.streamed[delta.index] = self.streamed.get(delta.index, "") + delta.text
        sent, safe = self.sent.get(delta.index, 0), _before_call(text)
        if safe <= sent:
            return None
        self.sent[delta.index] = safe
        piece = {"index": delta.index, "delta": {"content": text[sent:safe]}, "logprobs": lps, "finish_reason": None}
        return self.chunk(response_id, [piece])

    def _calls_chunk(self, response_id: str, index: int, text: str) -> dict[str, Any] | None:
        """Each call of a required list once complete (and once: protocol/call_list.py), numbered in its choice."""
        assert self.spec is not None
        reader = self.call_lists.setdefault(index, CallListReader(self.spec.names))
        before = len(reader.calls)
        new = reader.feed(text)
        if not new:
            return None
        calls = [{**call(name, arguments), "index": before + i} for i, (name, arguments) in enumerate(new)]
        piece = {"index": index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}
        return self.chunk(response_id, [piece])

    def closing(self, response_id: str, prompt_index: int, record: FinalRecord) -> list[dict[str, Any]]:
        chunks = []
        for c in choices_of(record):
            delta: dict[str, Any] | None = None
            if self.tools == "required":  # what the deltas left unread (none, when they carried the whole text)
                read = self.call_lists[c.index].fed if c.index in self.call_lists else 0
                rest = self._calls_chunk(response_id, c.index, c.text[read:])
                if rest is not None:
                    chunks.append(rest)
            elif self.spec is not None and self.tools == "auto":
                calls = self.spec.answer(c.text)[1]
                sent = self.sent.get(c.index, 0)
                if calls:
                    delta = {"tool_calls": [{**tc, "index": i} for i, tc in enumerate(calls)]}
                elif c.text[sent:]:
                    delta = {"content": c.text[sent:]}
            if delta is not None:
                piece = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}
                chunks.append(self.chunk(response_id, [piece]))
            reason = self._finish_reason(c.text, c.finish_reason)
            chunks.append(
                self.chunk(response_id, [{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason}])
            )
        return chunks


def _before_call(text: str) -> int:
    """How much of a streamed text is surely content: up to a <tool_call>, or to a tail that may start one."""
    if "<tool_call>" in text:
        return text.index("<tool_call>")
    for keep in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)
