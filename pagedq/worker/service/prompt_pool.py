"""Making prompts without holding up the loop: rendering a chat template and tokenising take time in proportion to the
prompt, and the loop thread steps the engine for every tenant, so a large prompt is made in a small pool while the
engine keeps stepping.

Each turn the loop asks for the jobs ready for admission (Prompts.ready): every prepared job, plus the waiting ones
it prepares now. In admission order (band, priority, read order), a job whose prompt-making is small is made on the
loop thread, as long as this turn's budget of `prompt_inline_chars` lasts (the rest wait for the next turn); a job
larger than that, or one whose size cannot be told cheaply (tools or tool calls through a front door), is handed to
the pool, as long as one of its `prompt_workers` is free (the rest wait in the backlog).

The pool is of processes by default, each with a copy of the engine's tokenizer: a chat template's rendering (jinja)
holds the GIL, and a thread rendering a large conversation slows every turn of the loop thread, which must take the
GIL back after each call that released it. A pool of threads (`prompt_pool thread`) starts at once and takes no
memory; it is enough where large prompts are text, as the tokenizers release the GIL while encoding.

A job made in the pool is prepared on the loop thread when its prompt is ready (a later turn), unless it was settled
meanwhile (cancelled, expired): then its prompt is dropped. A failure keeps its blame (engine_input.py): the loop
settles it as it settles a failure on the loop thread (a prompt process that died is the engine's failure). A text
too long by its characters alone is rejected before it is tokenised (protocol/prompt_size.py), on the loop thread
when that is all it takes."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import pickle
import tempfile
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from pagedq.worker.protocol.chat import uses_tools
from pagedq.worker.protocol.job import Job
from pagedq.worker.protocol.keys import band_rank
from pagedq.worker.protocol.prompt_size import max_chars_per_token
from pagedq.worker.service.admission import prepare
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.service.engine_api import WorkerEngine
from pagedq.worker.service.engine_input import MadePrompt, PromptBound, make_prompt, prompt_input
from pagedq.worker.service.held import WAITING, HeldJob, JobKey

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

MESSAGE_CHARS = 64  # what one message adds to a rendering's work beyond its content (its turn's markup), in chars
PROMPT_POOLS = ("process", "thread")
MAX_BROKEN_POOLS = 2  # process pools that may break (a process died, or could not load the tokenizer): then threads

_IN_PROCESS = SimpleNamespace(tokenizer=None)  # in a prompt process: its copy of the engine's tokenizer


def _adopt(path: str) -> None:
    """A prompt process's start: its copy of the tokenizer, from a file (through the start pipe, a large pickle would
    hold the loop thread until the new process had imported what unpickling it needs)."""
    with open(path, "rb") as fh:
        _IN_PROCESS.tokenizer = pickle.load(fh)


def _prompt_in_process(job: Job, bound: PromptBound) -> str | list[int]:
    return prompt_input(_IN_PROCESS, job, bound, as_ids=True)


class Prompts:
    def __init__(self, engine: WorkerEngine, settings: WorkerSettings, log: FilteringBoundLogger) -> None:
        if settings.prompt_pool not in PROMPT_POOLS:
            raise ValueError(f"prompt_pool must be one of {PROMPT_POOLS}, got {settings.prompt_pool!r}")
        self.engine, self.log, self.kind = engine, log, settings.prompt_pool
        self.workers, self.inline_chars = settings.prompt_workers, settings.prompt_inline_chars
        max_model_len = getattr(engine, "max_model_len", None)
        self.bound = PromptBound(
            max_model_len if isinstance(max_model_len, int) else None,
            max_chars_per_token(getattr(engine, "tokenizer", None)),
        )
        self._pool: Executor | None = None  # started with the first large prompt
        self._folder: tempfile.TemporaryDirectory[str] | None = None  # the tokenizer the prompt processes load
        self._making: dict[JobKey, tuple[HeldJob, Future[Any]]] = {}
        self._broken = 0  # process pools that broke

    @property
    def busy(self) -> bool:
        """Whether a prompt is being made in the pool."""
        return bool(self._making)

    def ready(self, waiting: list[HeldJob]) -> tuple[list[HeldJob], list[tuple[HeldJob, Exception]]]:
        """The waiting jobs ready for admission now, and those whose prompt-making failed (to settle: the loop's
        _engine_refused). Prepares what this turn's bounds allow: prompts made in the pool since the last turn,
        then small ones here, and hands large ones to the pool."""
        failed: list[tuple[HeldJob, Exception]] = []
        for t, future in self._collect():
            if t.state in WAITING:  # else settled while its prompt was made
                self._prepare(t, partial(self._made, future), failed)
        ready: list[HeldJob] = []
        budget = self.inline_chars
        for t in sorted(waiting, key=lambda t: (band_rank(t.band), t.job.vllm_priority, t.seq)):
            if t.prepared:
                ready.append(t)
                continue
            if t.key in self._making:
                continue
            work = self.inline_work(t)
            if work is not None and work <= self.inline_chars:
                if work <= budget:  # else it waits for the next turn's budget
                    budget -= work
                    self._prepare(t, partial(make_prompt, self.engine, t.job, self.bound), failed)
                    if t.prepared:
                        ready.append(t)
            elif len(self._making) < self.workers:
                self._start(t)
        return ready, failed

    def inline_work(self, t: HeldJob) -> int | None:
        """The characters a job's prompt-making goes through, as far as it is cheap to tell: a conversation's entry
        as read (its JSON: every content, tool and call), or its contents; None when it is not (tools or tool calls
        through a front door: their JSON would have to be written out to be measured)."""
        job, bound = t.job, self.bound
        if job.messages is not None:
            if t.size:
                return t.size
            if uses_tools(job.messages, job.tools):
                return None
            return sum(len(m.content or "") + MESSAGE_CHARS for m in job.messages)
        if job.prompt is not None:  # a text too long for the bound is rejected without tokenising it
            longest = (bound.max_model_len or 0) * (bound.chars_per_token or 0)
            return min(len(job.prompt), longest + 1) if longest else len(job.prompt)
        ids = job.prompt_token_ids or []  # checked against the max length before they are read
        return min(len(ids), (bound.max_model_len or len(ids)) + 1)

    def wait(self, timeout_s: float) -> None:
        """Until a prompt in the pool is ready, or timeout_s (the loop waits so when it has nothing else to do)."""
        if self._making:
            futures = [future for _, future in self._making.values()]
            concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        """At shutdown: drop what is being made (its jobs are left unacknowledged, as every unfinished one)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._making.clear()
        if self._folder is not None:
            self._folder.cleanup()

    def _start(self, t: HeldJob) -> None:
        if self._pool is None:
            self._pool = self._new_pool()
        future: Future[Any]
        if isinstance(self._pool, ProcessPoolExecutor):
            future = self._pool.submit(_prompt_in_process, t.job, self.bound)
        else:
            future = self._pool.submit(make_prompt, self.engine, t.job, self.bound, True)
        self._making[t.key] = (t, future)

    def _new_pool(self) -> Executor:
        if self.kind == "process":
            try:
                tokenizer = pickle.dumps(getattr(self.engine, "tokenizer", None))  # each process loads a copy
            except Exception as exc:
                self.log.warning("prompt_pool_threads", reason=f"the tokenizer cannot be pickled: {exc!r}"[:300])
            else:
                if self._folder is None:
                    self._folder = tempfile.TemporaryDirectory(prefix="pagedq-prompts-")
                path = Path(self._folder.name) / "tokenizer.pickle"
                path.write_bytes(tokenizer)
                context = multiprocessing.get_context("spawn")  # never fork a process that may hold a device
                return ProcessPoolExecutor(self.workers, mp_context=context, initializer=_adopt, initargs=(str(path),))
        return ThreadPoolExecutor(self.workers, thread_name_prefix="prompt")

    def _made(self, future: Future[Any]) -> MadePrompt:
        """A finished prompt-making's result: a thread's MadePrompt, or a process's prompt (counted here, by the
        engine: token ids are checked against the max length before they come back)."""
        try:
            result = future.result()
        except BrokenProcessPool:
            if self._pool is not None:  # a prompt process died (or could not start): the next large prompt starts a
                self._pool.shutdown(wait=False, cancel_futures=True)  # new pool; after a few, a pool of threads
                self._pool, self._broken = None, self._broken + 1
                if self._broken >= MAX_BROKEN_POOLS and self.kind == "process":
                    self.kind = "thread"
                    self.log.warning("prompt_pool_threads", reason=f"{self._broken} prompt process pools broke")
            raise
        if isinstance(result, MadePrompt):
            return result
        return MadePrompt(result, self.engine.num_prompt_tokens(result))

    def _collect(self) -> list[tuple[HeldJob, Future[Any]]]:
        done = [(key, t, future) for key, (t, future) in self._making.items() if future.done()]
        for key, _, _ in done:
            del self._making[key]
        return [(t, future) for _, t, future in done]

    def _prepare(self, t: HeldJob, made: Callable[[], MadePrompt], failed: list[tuple[HeldJob, Exception]]) -> None:
        """Prepare t (admission.prepare) from its prompt: a finished future's result, or made here by the call."""
        try:
            prepare(self.engine, t, made())
        except Exception as exc:
            failed.append((t, exc))
