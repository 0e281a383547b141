"""Token ids as text, for the records of jobs that ask for logprobs or echo: the gateway holds no tokenizer.

Each token is named as vLLM names it in logprobs: the tokenizer's decode of that one id (special tokens kept),
so a token that is part of a UTF-8 character reads as the replacement character. Decodes are cached: a
vocabulary's worth of short strings at most.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class TokenTexts:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def of(self, token_ids: Iterable[int]) -> dict[str, str]:
        """{str(id): text} for each id (JSON object keys are strings)."""
        cache, texts = self._cache, {}
        for token_id in token_ids:
            text = cache.get(token_id)
            if text is None:
                text = cache[token_id] = self._tokenizer.decode([token_id])
            texts[str(token_id)] = text
        return texts

    def decode(self, token_ids: list[int]) -> str:
        """A whole prompt given as token ids, as text (echo)."""
        return self._tokenizer.decode(token_ids)


def ids_named(token_ids: Iterable[int], entries: Iterable[dict[str, float] | None] | None) -> Iterable[int]:
    """The ids a record or delta names: its tokens and every alternative of its logprobs entries."""
    yield from token_ids
    for entry in entries or ():
        if entry:
            yield from (int(k) for k in entry)
