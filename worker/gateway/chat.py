"""POST /v1/chat/completions: messages as a chat job (the worker applies the model's chat template)."""

from __future__ import annotations

from typing import Any

from worker.gateway.completions import CompletionEndpoint
from worker.gateway.jobs import sampling_fields
from worker.gateway.render import chat_logprobs, choices_of, usage
from worker.gateway.schemas import ChatCompletionRequest
from worker.gateway.settings import GatewaySettings
from worker.protocol.job import Delta, FinalRecord


class ChatEndpoint(CompletionEndpoint):
    object_name = "chat.completion"
    id_prefix = "chatcmpl-"

    def __init__(self, body: ChatCompletionRequest | None, model: str, created: int, k: int | None = None) -> None:
        self.body, self.model, self.created = body, model, created
        self.k = ((body.top_logprobs or 0) if body.logprobs else None) if body is not None else k

    def chat_body(self) -> ChatCompletionRequest:
        body = self.request_body()
        if not isinstance(body, ChatCompletionRequest):
            raise TypeError(f"a chat endpoint got a {type(body).__name__}")
        return body

    def job_fields(self, settings: GatewaySettings) -> dict[str, Any]:
        body = self.chat_body()
        fields = sampling_fields(body, settings, body.max_completion_tokens or body.max_tokens)
        fields["messages"] = [{"role": m.role, "content": m.text()} for m in body.messages]
        if self.k is not None:
            fields["logprobs"] = self.k
        return fields

    def response(self, record: FinalRecord) -> dict[str, Any]:
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "finish_reason": c.finish_reason,
                "logprobs": chat_logprobs(c.token_ids, c.logprobs, self.k) if self.k is not None else None,
            }
            for c in choices_of(record)
        ]
        return self.envelope(record.id, choices, usage=usage(record))

    # --- streaming: object "chat.completion.chunk"; the first chunk of each choice names the role
    def chunk(self, job_id: str, choices: list[dict]) -> dict[str, Any]:
        return {**self.envelope(job_id, choices), "object": "chat.completion.chunk"}

    def opening(self, job_id: str) -> list[dict[str, Any]]:
        return [
            self.chunk(
                job_id,
                [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(self.request_body().n)
                ],
            )
        ]

    def delta_chunk(self, job_id: str, delta: Delta) -> dict[str, Any]:
        lps = chat_logprobs(delta.token_ids, delta.logprobs, self.k) if self.k is not None else None
        return self.chunk(
            job_id, [{"index": delta.index, "delta": {"content": delta.text}, "logprobs": lps, "finish_reason": None}]
        )

    def closing(self, record: FinalRecord) -> list[dict[str, Any]]:
        return [
            self.chunk(record.id, [{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason}])
            for c in choices_of(record)
        ]
