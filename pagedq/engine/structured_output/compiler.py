"""Grammars compiled off the step loop, on threads (xgrammar releases the GIL while compiling) in front of
xgrammar's compiler, whose cache is keyed by the spec and bounded in bytes.

A compile cannot be interrupted, so one that outlives its request's time limit keeps its thread until it ends. The
threads are therefore shared by source (an opaque key: the worker passes the job's tenant): each source runs at most
`per_source` compiles at once, its own slow or abandoned ones included, and its later compiles wait in its own
queue; other sources' compiles start on their own threads, up to `max_threads` in all, the fewest-running source
first once that is reached. One source's slow schemas cost that source, not everyone."""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

from pagedq.engine.errors import RequestRejected
from pagedq.engine.structured_output.backend import backend_message, xgrammar
from pagedq.engine.structured_output.params import StructuredOutputsParams

# Runs of optional whitespace inside JSON are cut at this length: no endless-whitespace outputs (xgrammar #412).
MAX_WHITESPACE_RUN = 8
# Sources whose compiles may run at once before a new source waits for a thread (threads = this x per_source)
MAX_SOURCES_RUNNING = 4


class GrammarCompilerPool:
    def __init__(self, tokenizer: Any, vocab_size: int, cache_bytes: int, num_threads: int = 2) -> None:
        xgr = xgrammar()
        # The model's vocab size, which can exceed the tokenizer's: the padded ids are then never allowed.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=num_threads, cache_enabled=True, cache_limit_bytes=cache_bytes
        )
        self.per_source = num_threads
        self.max_threads = num_threads * MAX_SOURCES_RUNNING
        self._pool = ThreadPoolExecutor(max_workers=self.max_threads, thread_name_prefix="pagedq-grammar")
        self._lock = threading.Lock()
        self._order = itertools.count()  # submission order: the oldest waiting compile of equals starts first
        self._waiting: dict[str, deque[tuple[int, Future, StructuredOutputsParams]]] = {}  # by source, in order
        self._running: dict[str, int] = {}  # source -> its compiles on a thread (those past their time limit too)
        self._num_running = 0

    def submit(self, params: StructuredOutputsParams, source: str = "") -> Future:
        """A future of (the CompiledGrammar, the seconds its compile took), or of the error that names what is
        wrong with the spec. It waits behind `source`'s own compiles; cancel() it while it waits to drop it."""
        future: Future = Future()
        with self._lock:
            self._waiting.setdefault(source, deque()).append((next(self._order), future, params))
            self._start_what_fits()
        # (after the lock: a future cancelled meanwhile runs its callback at once, and that takes the lock)
        future.add_done_callback(partial(self._forget_if_cancelled, source))
        return future

    def running(self, source: str) -> int:
        """How many of `source`'s compiles hold a thread now."""
        with self._lock:
            return self._running.get(source, 0)

    def waiting(self, source: str) -> int:
        """How many of `source`'s compiles wait for a thread."""
        with self._lock:
            return len(self._waiting.get(source, ()))

    def _forget_if_cancelled(self, source: str, future: Future) -> None:
        """A compile cancelled while it waits leaves its source's queue now, not when it comes up: a source whose
        compiles are stuck past their limit would otherwise pile up its requests' schemas there."""
        if not future.cancelled():
            return
        with self._lock:
            queue = self._waiting.get(source)
            if queue is None:
                return
            kept = deque(entry for entry in queue if entry[1] is not future)
            if kept:
                self._waiting[source] = kept
            else:
                del self._waiting[source]

    def _start_what_fits(self) -> None:
        """Under the lock: start waiting compiles while threads are free, the source with the fewest running first."""
        while self._num_running < self.max_threads:
            ready = [s for s in self._waiting if self._running.get(s, 0) < self.per_source]
            if not ready:
                return
            source = min(ready, key=lambda s: (self._running.get(s, 0), self._waiting[s][0][0]))
            queue = self._waiting[source]
            _, future, params = queue.popleft()
            if not queue:
                del self._waiting[source]
            if not future.set_running_or_notify_cancel():
                continue  # its request went away while it waited
            self._running[source] = self._running.get(source, 0) + 1
            self._num_running += 1
            self._pool.submit(self._run, future, params, source)

    def _run(self, future: Future, params: StructuredOutputsParams, source: str) -> None:
        try:
            start = time.perf_counter()
            compiled = self.compile(params)
            future.set_result((compiled, time.perf_counter() - start))
        except BaseException as error:  # handed to whoever waits on the future
            future.set_exception(error)
        finally:
            with self._lock:
                self._running[source] -= 1
                if not self._running[source]:
                    del self._running[source]
                self._num_running -= 1
                self._start_what_fits()

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
        except BACKEND_ERRORS as error:
            raise _refused(kind, error) from None

    @property
    def cache_size_bytes(self) -> int:
        return int(self._compiler.get_cache_size_bytes())

    def close(self) -> None:
        with self._lock:
            waiting = [future for queue in self._waiting.values() for _, future, _ in queue]
            self._waiting.clear()
        for future in waiting:
            future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)


def check_converts(params: StructuredOutputsParams) -> None:
    """RequestRejected naming the problem when xgrammar's converter refuses the spec (an unknown type, a regex or
    EBNF that does not parse), as vLLM refuses it when the request is added. The conversion alone, on the caller's
    thread (no vocabulary: cheap next to the compile, docs/structured-outputs.md); the compile stays on the pool."""
    grammar, kind = xgrammar().Grammar, params.kind
    try:
        if kind == "json":
            grammar.from_json_schema(
                json.dumps(params.schema),
                any_whitespace=not params.disable_any_whitespace,
                max_whitespace_cnt=MAX_WHITESPACE_RUN,
            )
        elif kind == "regex":
            grammar.from_regex(params.regex)
        elif kind == "grammar":
            grammar.from_ebnf(params.grammar)
        # json_object and choice make grammars of our own, which convert
    except BACKEND_ERRORS as error:
        raise _refused(kind, error) from None


BACKEND_ERRORS = (RuntimeError, ValueError, TypeError)  # how xgrammar refuses a spec


class ConversionCheck:
    """check_converts remembering its verdicts (by the spec's digest, the most recent `size`): the schema every
    request of a client repeats (its response_format) is converted once, not on every request's add."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()  # digest -> the refusal, None if it converts

    def __call__(self, params: StructuredOutputsParams) -> None:
        kind, text = params.spec()
        key = hashlib.sha256(f"{kind}\0{params.disable_any_whitespace}\0{text}".encode()).digest()
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
        else:
            try:
                check_converts(params)
                self._verdicts[key] = None
            except RequestRejected as refused:
                self._verdicts[key] = str(refused)
            if len(self._verdicts) > self.size:
                self._verdicts.popitem(last=False)
        refusal = self._verdicts[key]
        if refusal is not None:
            raise RequestRejected(refusal)


def _refused(kind: str, error: BaseException) -> RequestRejected:
    return RequestRejected(f"structured_outputs {kind} does not compile: {backend_message(error)}")


def choice_grammar(choices: list[str]) -> str:
    """EBNF matching exactly one of the strings (JSON string literals are valid EBNF literals in xgrammar)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
