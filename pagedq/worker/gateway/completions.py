"""POST /v1/completions: each prompt of the request as a job, the final records and deltas in OpenAI's shapes.

A request's prompts are one job each; choice `i * n + j` is sample j of prompt i (OpenAI's and vLLM's order).
With echo the prompt comes before the completion (in a stream: in each choice's first chunk), and with logprobs
the prompt's logprobs too (None for its first token); `max_tokens: 0` with echo scores the prompt only (the
engine samples one token, which is dropped, as vLLM does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.gateway.jobs import sampling_fields
from pagedq.worker.gateway.render import DONE, Entry, TokenNames, choices_of, completion_logprobs, event, usage
from pagedq.worker.gateway.schemas import CompletionRequest, SamplingBody
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.protocol.job import Delta, FinalRecord


@dataclass
class Echo:
    """A prompt as the worker reported it (its record or first delta), to put before its choices' text."""

    text: str
    token_ids: list[int]
    logprobs: list[Entry] | None


@dataclass
class StreamState:
    """Per choice of a stream: the characters sent so far (text_offset), whether its prompt went out."""

    sent_chars: dict[int, int] = field(default_factory=dict)
    echoed: set[int] = field(default_factory=set)
    prompts: dict[int, Echo] = field(default_factory=dict)


class CompletionEndpoint:
    object_name = "text_completion"
    chunk_object = "text_completion"  # a stream's chunks
    id_prefix = "cmpl-"
    prompt_param = "prompt"  # the request field that holds the prompt (named by a context-length refusal)
    body: SamplingBody | None  # each endpoint's own request type; None: only rendering records

    def __init__(self, body: CompletionRequest | None, model: str, created: int, k: int | None = None) -> None:
        """body None: only rendering a record (the Batch API), with `k` log-probabilities per token."""
        self.body, self.model, self.created = body, model, created
        self.k = body.logprobs if body is not None else k
        self.as_ids = bool(body and body.return_tokens_as_token_ids)
        self.echo = bool(body and body.echo)
        self.score_only = bool(body and body.echo and body.max_tokens == 0)
        self.n = body.n if body is not None else 1
        self.stream_state = StreamState()

    def request_body(self) -> SamplingBody:
        """The request being served (an endpoint made only to render records has none)."""
        if self.body is None:
            raise RuntimeError(f"{type(self).__name__} was made to render records: it has no request")
        return self.body

    def completion_body(self) -> CompletionRequest:
        body = self.request_body()
        if not isinstance(body, CompletionRequest):
            raise TypeError(f"a completion endpoint got a {type(body).__name__}")
        return body

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, whichever of OpenAI's four forms it used."""
        prompt = self.completion_body().prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return [prompt]  # a list of ints: one tokenized prompt
        return list(prompt)  # a list of strings or of token lists

    def jobs_fields(self, settings: GatewaySettings) -> list[dict[str, Any]]:
        body = self.completion_body()
        if body.suffix is not None:
            raise OpenAIError(400, "suffix is not supported", param="suffix", code="unsupported")
        prompts = self.prompts()
        if len(prompts) > settings.max_prompts:
            raise OpenAIError(
                400,
                f"{len(prompts)} prompts in one request, more than the limit of {settings.max_prompts} "
                "(send several requests, or use the Batch API)",
                param="prompt",
            )
        base = sampling_fields(body, settings, 1 if self.score_only else body.max_tokens or settings.default_max_tokens)
        if body.best_of is not None:
            base["best_of"] = body.best_of
        if self.k is not None:
            base["logprobs"] = self.k
        if self.echo:
            base["echo"] = True
            if self.k is not None:
                base["prompt_logprobs"] = self.k
        return [{**base, ("prompt" if isinstance(p, str) else "prompt_token_ids"): p} for p in prompts]

    def envelope(self, response_id: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id_prefix + response_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _echo_of(self, record: FinalRecord | Delta, prompt_index: int) -> Echo:
        text = record.prompt_text
        if text is None:  # a worker without a tokenizer: the prompt as the request gave it, when it was text
            given = self.prompts()[prompt_index] if self.body is not None else ""
            text = given if isinstance(given, str) else ""
        return Echo(text, list(record.prompt_token_ids or ()), record.prompt_logprobs)

    def _logprobs(
        self, token_ids: list[int], entries: Sequence[Entry] | None, texts: dict[str, str] | None, offset: int = 0
    ) -> dict | None:
        if self.k is None:
            return None
        return completion_logprobs(token_ids, entries or [], TokenNames(texts, self.as_ids), offset)

    def _with_echo(
        self, echo: Echo | None, text: str, token_ids: list[int], entries: Sequence[Entry] | None
    ) -> tuple[str, list[int], Sequence[Entry] | None]:
        if echo is None:
            return text, token_ids, entries
        prompt_entries = echo.logprobs or [None] * len(echo.token_ids)
        if self.score_only:
            return echo.text, echo.token_ids, prompt_entries
        return echo.text + text, [*echo.token_ids, *token_ids], [*prompt_entries, *(entries or [])]

    def response(self, records: list[FinalRecord]) -> dict[str, Any]:
        choices = []
        for prompt_index, record in enumerate(records):
            echo = self._echo_of(record, prompt_index) if self.echo else None
            for c in choices_of(record):
                text, token_ids, entries = self._with_echo(echo, c.text, c.token_ids, c.logprobs)
                choices.append(
                    {
                        "index": prompt_index * self.n + c.index,
                        "text": text,
                        "finish_reason": c.finish_reason,
                        "logprobs": self._logprobs(token_ids, entries, record.token_texts),
                        "stop_reason": c.stop_reason,
                    }
                )
        return self.envelope(records[0].id, choices, usage=usage(records))

    # --- streaming's framing (streaming.sse): each chunk a bare data event; usage (asked for) and [DONE] at the end
    def frame(self, chunk: dict[str, Any], include_usage: bool) -> bytes:
        return event({**chunk, "usage": None} if include_usage else chunk)

    def ending(self, response_id: str, records: list[FinalRecord], include_usage: bool) -> bytes:
        if not include_usage:
            return DONE
        return event({**self.envelope(response_id, []), "object": self.chunk_object, "usage": usage(records)}) + DONE

    def failure(self, error: OpenAIError) -> bytes:
        """What ends a stream that fails after its first byte: an error event, then a clean end."""
        return event(error.body()) + DONE

    # --- streaming: the prompts' chunks interleaved, each choice indexed prompt_index * n + sample index
    def opening(self, response_id: str) -> list[dict[str, Any]]:
        return []

    def delta_chunk(self, response_id: str, prompt_index: int, delta: Delta) -> dict[str, Any] | None:
        state, index = self.stream_state, prompt_index * self.n + delta.index
        if delta.prompt_token_ids is not None:
            state.prompts.setdefault(prompt_index, self._echo_of(delta, prompt_index))
        text, token_ids = delta.text, list(delta.token_ids)
        entries: Sequence[Entry] | None = delta.logprobs
        if self.echo and index not in state.echoed:
            state.echoed.add(index)
            text, token_ids, entries = self._with_echo(state.prompts.get(prompt_index), text, token_ids, entries)
        elif self.score_only:
            return None  # the one token sampled to score the prompt is not shown
        offset = state.sent_chars.get(index, 0)
        state.sent_chars[index] = offset + len(text)
        choice = {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(token_ids, entries, delta.token_texts, offset),
            "finish_reason": None,
        }
        return self.envelope(response_id, [choice])

    def closing(self, response_id: str, prompt_index: int, record: FinalRecord) -> list[dict[str, Any]]:
        return [
            self.envelope(
                response_id,
                [
                    {
                        "index": prompt_index * self.n + c.index,
                        "text": "",
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                ],
            )
            for c in choices_of(record)
        ]
