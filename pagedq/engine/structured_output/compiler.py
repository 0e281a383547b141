"""Grammars compiled off the step loop: a small thread pool (xgrammar releases the GIL while compiling) in front of
xgrammar's compiler, whose cache is keyed by the spec and bounded in bytes."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedq.engine.errors import RequestRejected
from pagedq.engine.structured_output.backend import xgrammar
from pagedq.engine.structured_output.params import StructuredOutputsParams

# Runs of optional whitespace inside JSON are cut at this length: no endless-whitespace outputs (xgrammar #412).
MAX_WHITESPACE_RUN = 8


class GrammarCompilerPool:
    def __init__(self, tokenizer: Any, vocab_size: int, cache_bytes: int, num_threads: int = 2) -> None:
        xgr = xgrammar()
        # The model's vocab size, which can exceed the tokenizer's: the padded ids are then never allowed.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=num_threads, cache_enabled=True, cache_limit_bytes=cache_bytes
        )
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="pagedq-grammar")

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of (the CompiledGrammar, the seconds its compile took), or of the error that names what is
        wrong with the spec."""
        return self._pool.submit(self._timed_compile, params)

    def _timed_compile(self, params: StructuredOutputsParams) -> tuple[Any, float]:
        start = time.perf_counter()
        compiled = self.compile(params)
        return compiled, time.perf_counter() - start

    def compile(self, params: StructuredOutputsParams) -> Any:
        compiler, kind = self._compiler, params.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(
                    json.dumps(params.schema),
                    any_whitespace=not params.disable_any_whitespace,
                    max_whitespace_cnt=MAX_WHITESPACE_RUN,
                )
            if kind == "json_object":  # any object, whitespace bounded as for a schema
                return compiler.compile_json_schema(
                    '{"type": "object"}',
                    any_whitespace=not params.disable_any_whitespace,
                    max_whitespace_cnt=MAX_WHITESPACE_RUN,
                )
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice or []))
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's parse errors
            raise RequestRejected(f"structured_outputs {kind} does not compile: {_first_line(error)}") from None

    @property
    def cache_size_bytes(self) -> int:
        return int(self._compiler.get_cache_size_bytes())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def choice_grammar(choices: list[str]) -> str:
    """EBNF matching exactly one of the strings (JSON string literals are valid EBNF literals in xgrammar)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:500] if text else type(error).__name__
