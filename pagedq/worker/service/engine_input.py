"""What the engine gets for a job's prompt, and whose fault it is when that cannot be made: the caller's (the job is
rejected: RequestRejected) or the engine's (any other exception: the job is retried, service/recovery.py).

make_prompt is the whole of a job's prompt-making (rendering, the size bound, tokenising): it touches nothing of the
loop's, so it runs on the loop thread for a small job and in the prompt pool for a large one (service/prompt_pool.py),
with the same result either way."""

from __future__ import annotations

from dataclasses import dataclass

from pagedq.worker.protocol.chat import render_conversation
from pagedq.worker.protocol.job import Job
from pagedq.worker.protocol.prompt_size import chars_over, conversation_chars, tokens_over
from pagedq.worker.service.engine_api import RequestRejected, WorkerEngine


@dataclass(frozen=True)
class PromptBound:
    """What bounds a prompt before it is tokenised: the engine's max length (prompt + max_tokens) and the most
    characters one token of its tokenizer stands for (protocol/prompt_size.py); None where unknown."""

    max_model_len: int | None = None
    chars_per_token: int | None = None

    def check_chars(self, chars: int, job: Job) -> None:
        """ContextLengthExceeded when a text of this many characters cannot fit with the job's max_tokens."""
        if self.max_model_len is not None:
            refusal = chars_over(chars, job, self.max_model_len, self.chars_per_token)
            if refusal is not None:
                raise refusal

    def check_tokens(self, count: int, job: Job) -> None:
        refusal = tokens_over(count, job, self.max_model_len) if self.max_model_len is not None else None
        if refusal is not None:
            raise refusal


@dataclass(frozen=True)
class MadePrompt:
    engine_input: str | list[int]  # what engine.add_request gets
    num_prompt_tokens: int  # the engine's own count of it


def make_prompt(engine: WorkerEngine, job: Job, bound: PromptBound, as_ids: bool = False) -> MadePrompt:
    """The job's prompt as the engine gets it (prompt_input), and the engine's count of its tokens."""
    prompt = prompt_input(engine, job, bound, as_ids)
    return MadePrompt(prompt, engine.num_prompt_tokens(prompt))


def prompt_input(source: object, job: Job, bound: PromptBound, as_ids: bool = False) -> str | list[int]:
    """The job's prompt as the engine gets it (engine_prompt). source: the engine, or anything holding its tokenizer
    (a prompt process's copy, service/prompt_pool.py). A text too long to fit by its characters alone is rejected
    before it is tokenised, and token ids longer than the model's length as soon as they are counted.
    as_ids: a text prompt is tokenised here, as the engine would (its tokenizer's encode, special tokens added),
    and handed over as token ids, so the engine does not tokenise it again on the loop thread."""
    if job.prompt_token_ids is not None and job.messages is None and job.prompt is None:
        bound.check_tokens(len(job.prompt_token_ids), job)
        return job.prompt_token_ids
    prompt = engine_prompt(source, job, bound)
    tokenizer = getattr(source, "tokenizer", None)
    if isinstance(prompt, str) and prompt and as_ids and tokenizer is not None:
        prompt = list(tokenizer.encode(prompt))
    if isinstance(prompt, list):
        bound.check_tokens(len(prompt), job)
    return prompt


def engine_prompt(source: object, job: Job, bound: PromptBound | None = None) -> str | list[int]:
    """What the engine gets: the prompt, the token ids, or the messages rendered with the model's chat template
    (`apply_chat_template(..., add_generation_prompt=True)`, tools natively or in the Hermes form: protocol/chat.py)
    and tokenized without special tokens, as transformers does: the template writes BOS itself where the model
    wants one, so encoding the text with special tokens would double it (source: the engine, or what holds its
    tokenizer). A text prompt, or the rendered conversation, is checked against the bound by its characters before
    it is tokenised, and a conversation by what every template writes of it before it is rendered.

    Raises RequestRejected (the job is rejected) for what the caller owns: a conversation sent to a model without a
    chat template, or one the template refuses (jinja's TemplateError, raised by a template's raise_exception for
    e.g. roles that do not alternate; a ValueError from the rendering, as transformers and protocol/chat.py raise
    for input they cannot take), or a text too long by its characters alone. Anything else the tokenizer raises,
    and any failure to encode the rendered text, is a crash of the engine's tokenizer: it propagates, and the job
    is retried (service/recovery.py)."""
    bound = bound or PromptBound()
    if job.messages is None:
        if job.prompt is not None:
            bound.check_chars(len(job.prompt), job)
            return job.prompt
        if job.prompt_token_ids is not None:
            return job.prompt_token_ids
        raise RequestRejected("the job has none of prompt, prompt_token_ids and messages")
    tokenizer = getattr(source, "tokenizer", None)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestRejected(
            "the model has no chat template: send the conversation as a formatted `prompt` instead of `messages`"
        )
    bound.check_chars(conversation_chars(job), job)  # what any template writes of it: before rendering it
    try:
        text = render_conversation(tokenizer, job.messages, job.tools, job.tool_call_parser)
    except Exception as exc:
        from jinja2 import TemplateError  # jinja comes with transformers; only a refusal needs it

        if isinstance(exc, (ValueError, TemplateError)):
            raise RequestRejected(f"the chat template refused the messages: {exc}") from None
        raise
    bound.check_chars(len(text), job)
    return tokenizer.encode(text, add_special_tokens=False)
