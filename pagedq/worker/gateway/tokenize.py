"""POST /tokenize and /detokenize in vLLM's shapes, served here from the tokenizer files a worker of the model
published at start (pagedq/worker/service/tokenizer_files.py): the same tokenizer the engine uses, without a round trip
to a worker that may be busy generating. A prompt is tokenized as the engine tokenizes it (special tokens added);
messages (and tools) as the worker renders a chat job's (protocol/chat.py's render_conversation: the chat template,
tools natively or in the Hermes form, then no special tokens), so the count is a chat completion's prompt_tokens."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from pydantic import Field, TypeAdapter, ValidationError

from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.gateway.jobs import check_model
from pagedq.worker.gateway.schemas import ChatMessage, Strict, Tool
from pagedq.worker.gateway.workers import LiveWorkers
from pagedq.worker.protocol import chat, tool_calls
from pagedq.worker.protocol.job import MAX_PROMPT_CHARS, TokenId
from pagedq.worker.protocol.keys import QueueKeys

NOT_FILES = (b"digest", b"max_model_len", b"chars_per_token")  # published beside the files (tokenizer_files.py)


class TokenizeRequest(Strict):
    model: str = Field(min_length=1, max_length=512)
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=10_000)
    tools: list[Tool] | None = Field(default=None, max_length=128)  # rendered with the messages, as a chat job's
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str = Field(min_length=1, max_length=512)
    tokens: list[TokenId] = Field(max_length=MAX_PROMPT_CHARS)


class Tokenizers:
    """Each served model's tokenizer, loaded from its published files once per digest (a new one reloads)."""

    def __init__(self, redis_client: Any, keys: QueueKeys, live: LiveWorkers, queue: str) -> None:
        self.r, self.keys, self.live, self.queue = redis_client, keys, live, queue
        self._loaded: dict[str, tuple[bytes, Any, int | None]] = {}

    async def get(self, model: str) -> tuple[Any, int | None]:
        """(tokenizer, max_model_len) of a served model; 503 when none of its workers published one."""
        name = await check_model(self.live, model, self.queue)
        key = self.keys.tokenizer(name)
        digest = await self.r.hget(key, "digest")
        if digest is None:
            raise OpenAIError(503, f"no tokenizer published for model {name!r}", code="no_tokenizer")
        cached = self._loaded.get(name)
        if cached is None or cached[0] != digest:
            fields = await self.r.hgetall(key)
            files = {k.decode(): v for k, v in fields.items() if k not in NOT_FILES}
            tokenizer = await asyncio.to_thread(_load, files)
            raw_len = fields.get(b"max_model_len")
            cached = self._loaded[name] = (digest, tokenizer, int(raw_len) if raw_len else None)
        return cached[1], cached[2]

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "exactly one of prompt or messages must be given", param="prompt")
        tokenizer, max_model_len = await self.get(body.model)
        ids = await asyncio.to_thread(_encode, tokenizer, body)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        tokenizer, _ = await self.get(body.model)
        vocab = len(tokenizer)
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise OpenAIError(400, f"token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}


def _load(files: dict[str, bytes]) -> Any:
    from transformers import AutoTokenizer  # torch-free; imported on the first /tokenize only

    with tempfile.TemporaryDirectory() as folder:
        for name, data in files.items():
            (Path(folder) / Path(name).name).write_bytes(data)
        return AutoTokenizer.from_pretrained(folder)


def _encode(tokenizer: Any, body: TokenizeRequest) -> list[int]:
    if body.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise OpenAIError(400, "the model has no chat template: send a prompt", param="messages")
        messages, tools = _conversation(body)
        try:
            text = chat.render_conversation(
                tokenizer,
                messages,
                tools,
                None,  # no answer is parsed here: a template writing its own calls renders too
                add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message,
            )
        except Exception as exc:  # jinja raises for e.g. roles that do not alternate, as a chat job is rejected
            raise OpenAIError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        special = bool(body.add_special_tokens)
    else:
        text, special = body.prompt or "", body.add_special_tokens is not False
    return list(tokenizer.encode(text, add_special_tokens=special))


_JOB_MESSAGES: TypeAdapter[list[chat.ChatMessage]] = TypeAdapter(list[chat.ChatMessage])
_JOB_TOOLS: TypeAdapter[list[chat.Tool] | None] = TypeAdapter(list[chat.Tool] | None)


def _conversation(body: TokenizeRequest) -> tuple[list[chat.ChatMessage], list[chat.Tool] | None]:
    """The messages and tools as a chat job carries them (tool_calls.conversation_fields, the chat endpoint's)."""
    assert body.messages is not None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    try:
        fields = tool_calls.conversation_fields(
            [m.model_dump(exclude_none=True) for m in body.messages], tools, "required" if tools else None
        )
        return _JOB_MESSAGES.validate_python(fields["messages"]), _JOB_TOOLS.validate_python(fields.get("tools"))
    except tool_calls.RequestFieldError as error:
        raise OpenAIError(400, str(error), param=error.param) from None
    except ValidationError as error:
        raise OpenAIError(400, f"messages: {error.errors()[0]['msg']}", param="messages") from None


def router(tokenizers: Tokenizers, auth: Any) -> APIRouter:
    routes = APIRouter(dependencies=[auth])

    @routes.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await tokenizers.tokenize(body)

    @routes.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await tokenizers.detokenize(body)

    return routes
