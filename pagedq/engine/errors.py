"""What the engine raises when a request, not the engine, is at fault."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request the engine refuses as given: bad sampling, structured-output or beam-search parameters, a prompt
    that does not fit, a feature this engine cannot serve. The same request fails the same way on every try, so a
    caller that retries errors (the queue worker) rejects the job on this one instead. A ValueError, as before.

    The engine's own configuration (EngineConfig, its flags) stays a plain ValueError: no request is to blame."""


class ContextLengthExceeded(RequestRejected):
    """A prompt that, with the room asked for its output, does not fit the model's context: worded as vLLM and OpenAI
    word it ("This model's maximum context length is ..."), the words client libraries look for to shorten a
    conversation. max_tokens None: the output takes the rest of the context, so the prompt must leave one token.
    chars: the prompt was measured by this many characters, not tokenised (its count is a lower bound)."""

    code = "context_length_exceeded"

    def __init__(
        self,
        max_model_len: int,
        prompt_tokens: int,
        max_tokens: int | None,
        source: str = "prompt",
        chars: int | None = None,
    ) -> None:
        self.max_model_len, self.prompt_tokens, self.max_tokens = max_model_len, prompt_tokens, max_tokens
        self.source, self.chars = source, chars  # source: "prompt" or "messages", the request's field that holds it
        bound, measured = ("at least ", f", counted from {chars} characters") if chars is not None else ("", "")
        head = f"This model's maximum context length is {max_model_len} tokens. However, "
        if max_tokens is None:
            tail = (
                f"your {source} resulted in {bound}{prompt_tokens} tokens{measured}. "
                f"Please reduce the length of the {source}."
            )
        else:
            tail = (
                f"you requested {bound}{prompt_tokens + max_tokens} tokens ({bound}{prompt_tokens} in the {source}"
                f"{measured}, {max_tokens} in the completion). Please reduce the length of the {source} or completion."
            )
        super().__init__(head + tail)

    def __reduce__(self) -> tuple[type[ContextLengthExceeded], tuple[int, int, int | None, str, int | None]]:
        """Pickled whole (a prompt process raises it, service/prompt_pool.py): its arguments, not its message."""
        return type(self), (self.max_model_len, self.prompt_tokens, self.max_tokens, self.source, self.chars)


def check_context_fits(
    max_model_len: int, prompt_tokens: int, max_tokens: int | None, source: str = "prompt", chars: int | None = None
) -> None:
    """ContextLengthExceeded unless the prompt and max_tokens fit (max_tokens None: the prompt leaves one token)."""
    if prompt_tokens + (1 if max_tokens is None else max_tokens) > max_model_len:
        raise ContextLengthExceeded(max_model_len, prompt_tokens, max_tokens, source, chars)
