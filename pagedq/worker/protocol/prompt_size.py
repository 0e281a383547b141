"""A prompt's size bound from its characters alone, before any tokenising: the most characters one token of a
tokenizer can stand for. A text of C characters is then at least ceil(C / that) tokens, so one whose characters
cannot fit the model's length is refused without being tokenised (the worker, service/prompt_pool.py, and the
gateway, gateway/prompt_limits.py, both ask this).

The bound must never refuse a prompt that would fit, so it is given only for tokenizers where it is provably a
lower bound on the count: a BPE model that never merges unknown characters into one token (byte-level, byte
fallback, or no fused unknowns), no pre-tokenizer or normalizer that removes characters (whitespace splitting,
stripping, SentencePiece's charsmap, a regular expression's replacement), and no added token that swallows the
whitespace beside it. A composing Unicode normalizer (NFC, NFKC) may fold a few characters into one before
tokenising, and a fixed replacement (SentencePiece's " " to "▁") may shorten the text by its ratio: the bound allows
for both. Any other tokenizer gets no bound (None), and prompts are only counted by tokenising them."""

from __future__ import annotations

import json
from typing import Any

from pagedq.engine.errors import ContextLengthExceeded, check_context_fits
from pagedq.worker.protocol.job import Job

# Pre-tokenizers and normalizers that keep every character of the text (each one maps to at least one character)
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Sequence", "Split"}
_KEEPING_NORMALIZERS = {"NFD", "NFKD", "NFC", "NFKC", "Lowercase", "Prepend", "Sequence"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
# A conversation measured before a chat template writes it (conversation_chars): only what every template writes in
# full counts, the turns below (a template may shorten earlier assistant turns, e.g. drop their reasoning) and the
# tools' definitions at 1/TOOL_JSON_SHARE of their compact JSON (a template may write a schema more tersely)
WRITTEN_ROLES = ("system", "developer", "user", "tool")
TOOL_JSON_SHARE = 2
# Canonical composition folds a base and its combining marks, or a Hangul syllable's jamo, into one character: a
# generous factor for how many characters can become one
COMPOSITION_FACTOR = 4


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, or None when no safe bound is known. A tokenizer may
    state it (`max_chars_per_token`, as the stub engine's does); a Hugging Face fast tokenizer is read from its
    tokenizer.json."""
    stated = getattr(tokenizer, "max_chars_per_token", None)
    if isinstance(stated, int) and stated > 0:
        return stated
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        vocab = tokenizer.get_vocab()
    except Exception:
        return None
    factor = _factor(spec)
    if factor is None or not vocab:
        return None
    return factor * max(len(token) for token in vocab)


def _factor(spec: dict[str, Any]) -> int | None:
    """1, COMPOSITION_FACTOR (a composing normalizer), or None (no safe bound) from a tokenizer.json's parts."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    byte_level = any(part.get("type") == "ByteLevel" for part in _parts(spec.get("pre_tokenizer")))
    if model.get("fuse_unk") and not (byte_level or model.get("byte_fallback")):
        return None  # a run of unknown characters becomes one token
    for part in _parts(spec.get("pre_tokenizer")):
        if part.get("type") not in _KEEPING_PRE_TOKENIZERS or part.get("behavior") == "Removed":
            return None
    if any(token.get("lstrip") or token.get("rstrip") for token in spec.get("added_tokens") or []):
        return None  # such a token takes in the whitespace beside it
    factor = 1
    for part in _parts(spec.get("normalizer")):
        kind = part.get("type")
        if kind in _COMPOSING_NORMALIZERS:
            factor *= COMPOSITION_FACTOR
        elif kind == "Replace":  # SentencePiece's " " -> "▁": a fixed string for a non-empty one shrinks by its ratio
            pattern, content = (part.get("pattern") or {}).get("String"), part.get("content")
            if not pattern or not content:
                return None  # a regular expression, or a removal
            factor *= -(-len(pattern) // len(content))
        elif kind not in _KEEPING_NORMALIZERS:
            return None
    return factor


def _parts(component: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A normalizer or pre-tokenizer and, for a Sequence, each of its parts."""
    if not component:
        return []
    inner = component.get("normalizers") or component.get("pretokenizers")
    if component.get("type") == "Sequence" and isinstance(inner, list):
        return [part for piece in inner for part in _parts(piece)]
    return [component]


def prompt_source(job: Job) -> str:
    """The request field a job's prompt came from, as the context-length refusal names it."""
    return "messages" if job.messages is not None else "prompt"


def tokens_over(count: int, job: Job, max_model_len: int) -> ContextLengthExceeded | None:
    """The refusal of a prompt of `count` tokens that cannot fit with the job's max_tokens, or None when it fits."""
    try:
        check_context_fits(max_model_len, count, job.max_tokens, prompt_source(job))
    except ContextLengthExceeded as exc:
        return exc
    return None


def chars_over(chars: int, job: Job, max_model_len: int, chars_per_token: int | None) -> ContextLengthExceeded | None:
    """The refusal of a text of `chars` characters that cannot fit with the job's max_tokens by its characters
    alone (at least ceil(chars / chars_per_token) tokens), or None when it might."""
    if chars_per_token is None:
        return None
    try:
        check_context_fits(max_model_len, -(-chars // chars_per_token), job.max_tokens, prompt_source(job), chars)
    except ContextLengthExceeded as exc:
        return exc
    return None


def conversation_chars(job: Job) -> int:
    """The characters every chat template writes of a job's conversation at least (0 for a job without one)."""
    chars = sum(len(m.content or "") for m in job.messages or () if m.role in WRITTEN_ROLES)
    for tool in job.tools or ():
        compact = json.dumps(tool.model_dump(exclude_none=True), separators=(",", ":"), ensure_ascii=False)
        chars += len(compact) // TOOL_JSON_SHARE
    return chars
