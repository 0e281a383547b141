"""Making prompts without holding up the loop: rendering a chat template and tokenising take time in proportion to the
prompt, and the loop thread steps the engine for every tenant, so a large prompt is made in a small thread pool
while the engine keeps stepping.

Each turn the loop asks for the jobs ready for admission (Prompts.ready): every prepared job, plus the waiting ones
it prepares now. In admission order (band, priority, read order), a job whose prompt-making is small is made on the
loop thread, as long as this turn's budget of `prompt_inline_chars` lasts (the rest wait for the next turn); a job
larger than that, or one whose size cannot be told cheaply (tools, tool calls), is handed to the pool, as long as
one of its `prompt_workers` threads is free (the rest wait in the backlog). Threads suffice: the tokenizers release
the GIL while encoding, and a chat template's rendering, which does not, is bounded by the job's own limits.

A job made in the pool is prepared on the loop thread when its prompt is ready (a later turn), unless it was settled
meanwhile (cancelled, expired): then its prompt is dropped. A failure keeps its blame (engine_input.py): the loop
settles it as it settles a failure on the loop thread. A text too long by its characters alone is rejected before
it is tokenised (protocol/prompt_size.py), on the loop thread when that is all it takes."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from pagedq.worker.protocol.chat import uses_tools
from pagedq.worker.protocol.keys import band_rank
from pagedq.worker.protocol.prompt_size import max_chars_per_token
from pagedq.worker.service.admission import prepare
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.service.engine_api import WorkerEngine
from pagedq.worker.service.engine_input import MadePrompt, PromptBound, make_prompt
from pagedq.worker.service.held import WAITING, HeldJob, JobKey

MESSAGE_CHARS = 64  # what one message adds to a rendering's work beyond its content (its turn's markup), in chars


class Prompts:
    def __init__(self, engine: WorkerEngine, settings: WorkerSettings) -> None:
        self.engine = engine
        self.workers, self.inline_chars = settings.prompt_workers, settings.prompt_inline_chars
        max_model_len = getattr(engine, "max_model_len", None)
        self.bound = PromptBound(
            max_model_len if isinstance(max_model_len, int) else None,
            max_chars_per_token(getattr(engine, "tokenizer", None)),
        )
        self._pool: ThreadPoolExecutor | None = None  # started with the first large prompt
        self._making: dict[JobKey, tuple[HeldJob, Future[MadePrompt]]] = {}

    @property
    def busy(self) -> bool:
        """Whether a prompt is being made in the pool."""
        return bool(self._making)

    def ready(self, waiting: list[HeldJob]) -> tuple[list[HeldJob], list[tuple[HeldJob, Exception]]]:
        """The waiting jobs ready for admission now, and those whose prompt-making failed (to settle: the loop's
        _engine_refused). Prepares what this turn's bounds allow: prompts made in the pool since the last turn,
        then small ones here, and hands large ones to the pool."""
        failed: list[tuple[HeldJob, Exception]] = []
        for t, made in self._collect():
            if t.state in WAITING:  # else settled while its prompt was made
                self._prepare(t, made.result, failed)
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
        """The characters a job's prompt-making goes through, as far as it is cheap to tell; None when it is not
        (tools and tool calls: their JSON would have to be written out to be measured)."""
        job, bound = t.job, self.bound
        if job.messages is not None:
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

    def _start(self, t: HeldJob) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="prompt")
        future = self._pool.submit(make_prompt, self.engine, t.job, self.bound, True)
        self._making[t.key] = (t, future)

    def _collect(self) -> list[tuple[HeldJob, Future[MadePrompt]]]:
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
