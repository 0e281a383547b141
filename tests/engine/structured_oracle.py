"""An independent check of structured outputs: a fresh xgrammar compiler and matcher replay each output and say
whether every token was one the grammar allowed at its position (shared by the structured-output tests)."""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from pagedq.engine import StructuredOutputsParams
from pagedq.engine.structured_output.compiler import choice_grammar


class GrammarReplay:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, params: StructuredOutputsParams):
        if params.kind in ("json", "json_object"):
            schema = json.dumps(params.schema) if params.kind == "json" else '{"type": "object"}'
            return self.compiler.compile_json_schema(
                schema, any_whitespace=not params.disable_any_whitespace, max_whitespace_cnt=8
            )
        if params.kind == "regex":
            return self.compiler.compile_regex(params.regex)
        text = choice_grammar(params.choice or []) if params.kind == "choice" else params.grammar
        return self.compiler.compile_grammar(text)

    def refused(self, params: StructuredOutputsParams, token_ids: list[int], stop_ids: list[int]) -> list[int]:
        """Positions of tokens the grammar did not allow (empty: every token was allowed)."""
        matcher = xgr.GrammarMatcher(self.compile(params), override_stop_tokens=stop_ids)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        bad = []
        for position, token in enumerate(token_ids):
            matcher.fill_next_token_bitmask(bitmask, 0)
            allowed = (int(bitmask[0, token // 32]) >> (token % 32)) & 1
            if not allowed or not matcher.accept_token(token):
                bad.append(position)
                break
        return bad

    def is_complete(self, params: StructuredOutputsParams, token_ids: list[int], stop_ids: list[int]) -> bool:
        matcher = xgr.GrammarMatcher(self.compile(params), override_stop_tokens=stop_ids)
        return all(matcher.accept_token(t) for t in token_ids) and matcher.is_completed()


def text_matches(params: StructuredOutputsParams, text: str) -> bool:
    """A finished output read back by an independent parser: json / re / the choice list."""
    if params.kind in ("json", "json_object"):
        import jsonschema

        value = json.loads(text)
        jsonschema.validate(value, params.schema if params.kind == "json" else {"type": "object"})
        return True
    if params.kind == "regex":
        return re.fullmatch(params.regex or "", text) is not None
    if params.kind == "choice":
        return text in (params.choice or [])
    return True
