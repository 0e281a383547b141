"""What the engine gets for a job's prompt, and whose fault it is when that cannot be made: the caller's (the job is
rejected: RequestRejected) or the engine's (any other exception: the job is retried, service/recovery.py)."""

from __future__ import annotations

from pagedq.worker.protocol.chat import render_conversation
from pagedq.worker.protocol.job import Job
from pagedq.worker.service.engine_api import RequestRejected, WorkerEngine


def engine_prompt(engine: WorkerEngine, job: Job) -> str | list[int]:
    """What the engine gets: the prompt, the token ids, or the messages rendered with the model's chat template
    (`apply_chat_template(..., add_generation_prompt=True)`, tools natively or in the Hermes form: protocol/chat.py)
    and tokenized without special tokens, as transformers does: the template writes BOS itself where the model
    wants one, so encoding the text with special tokens would double it.

    Raises RequestRejected (the job is rejected) for what the caller owns: a conversation sent to a model without a
    chat template, or one the template refuses (jinja's TemplateError, raised by a template's raise_exception for
    e.g. roles that do not alternate; a ValueError from the rendering, as transformers and protocol/chat.py raise
    for input they cannot take). Anything else the tokenizer raises, and any failure to encode the rendered text,
    is a crash of the engine's tokenizer: it propagates, and the job is retried (service/recovery.py)."""
    if job.messages is None:
        if job.prompt is not None:
            return job.prompt
        if job.prompt_token_ids is not None:
            return job.prompt_token_ids
        raise RequestRejected("the job has none of prompt, prompt_token_ids and messages")
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestRejected(
            "the model has no chat template: send the conversation as a formatted `prompt` instead of `messages`"
        )
    try:
        text = render_conversation(tokenizer, job.messages, job.tools, job.tool_call_parser)
    except Exception as exc:
        from jinja2 import TemplateError  # jinja comes with transformers; only a refusal needs it

        if isinstance(exc, (ValueError, TemplateError)):
            raise RequestRejected(f"the chat template refused the messages: {exc}") from None
        raise
    return tokenizer.encode(text, add_special_tokens=False)
