"""POST /v1/completions: the request as a job, the final record and deltas in OpenAI's shapes."""

from __future__ import annotations

from typing import Any

from worker.gateway.errors import OpenAIError
from worker.gateway.jobs import sampling_fields
from worker.gateway.render import choices_of, completion_logprobs, usage
from worker.gateway.schemas import CompletionRequest, SamplingBody
from worker.gateway.settings import GatewaySettings
from worker.protocol.job import Delta, FinalRecord


class CompletionEndpoint:
    object_name = "text_completion"
    id_prefix = "cmpl-"
    body: SamplingBody | None  # each endpoint's own request type; None: only rendering records

    def __init__(self, body: CompletionRequest | None, model: str, created: int, k: int | None = None) -> None:
        """body None: only rendering a record (the Batch API), with `k` log-probabilities per token."""
        self.body, self.model, self.created = body, model, created
        self.k = body.logprobs if body is not None else k

    def request_body(self) -> SamplingBody:
        """The request being served (an endpoint made only to render records has none)."""
        if self.body is None:
            raise RuntimeError(f"{type(self).__name__} was made to render records: it has no request")
        return self.body

    def job_fields(self, settings: GatewaySettings) -> dict[str, Any]:
        body = self.request_body()
        if not isinstance(body, CompletionRequest):
            raise TypeError(f"a completion endpoint got a {type(body).__name__}")
        fields = sampling_fields(body, settings, body.max_tokens)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # a list of prompts
            if len(prompt) != 1:
                raise OpenAIError(
                    400,
                    "one prompt per request (send several requests, or use the Batch API)",
                    param="prompt",
                    code="unsupported",
                )
            prompt = prompt[0]
        if isinstance(prompt, list):
            fields["prompt_token_ids"] = prompt
        else:
            fields["prompt"] = prompt
        if self.k is not None:
            fields["logprobs"] = self.k
        return fields

    def envelope(self, job_id: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id_prefix + job_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def response(self, record: FinalRecord) -> dict[str, Any]:
        choices = [
            {
                "index": c.index,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": completion_logprobs(c.token_ids, c.logprobs, self.k or 0) if self.k is not None else None,
            }
            for c in choices_of(record)
        ]
        return self.envelope(record.id, choices, usage=usage(record))

    # --- streaming
    def opening(self, job_id: str) -> list[dict[str, Any]]:
        return []

    def delta_chunk(self, job_id: str, delta: Delta) -> dict[str, Any]:
        lps = completion_logprobs(delta.token_ids, delta.logprobs, self.k or 0) if self.k is not None else None
        return self.envelope(
            job_id, [{"index": delta.index, "text": delta.text, "logprobs": lps, "finish_reason": None}]
        )

    def closing(self, record: FinalRecord) -> list[dict[str, Any]]:
        return [
            self.envelope(
                record.id, [{"index": c.index, "text": "", "logprobs": None, "finish_reason": c.finish_reason}]
            )
            for c in choices_of(record)
        ]
