"""What the engine drives for structured outputs: requests waiting for their grammar, one matcher per sequence,
and the per-step masks.

    submit()   the request's grammar starts compiling; the request is held here, not in the scheduler
    poll()     compiled -> handed to the scheduler; failed or past the time limit -> finished with the error
    attach()   a prepared step gets a StepMask over its structured draws (none: the step never waits)
    advance()  after a step, each live structured sequence's matcher accepts its new tokens; a rejected token
               ends that request with an error, a finished grammar stops it
    fill_pending()  the masks of steps already launched, now that their sequences' tokens are known (async):
               filled on a background thread while the engine schedules the next step; settle() waits for them
               before any matcher moves again
    advance_early()  async, before a step's processing: the matchers take its tokens first and the launched
               step's mask fills at once, so that step's sampling waits for the matchers, not the whole batch
"""

from __future__ import annotations

import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from pagedq.engine.core.request import Request, RequestStatus
from pagedq.engine.errors import RequestRejected
from pagedq.engine.output.outputs import RequestOutput
from pagedq.engine.structured_output.compiler import GrammarCompilerPool
from pagedq.engine.structured_output.matcher import SequenceGrammar
from pagedq.engine.structured_output.step_mask import StepMask


@dataclass
class _Compiling:
    request: Request
    future: Future
    deadline: float


@dataclass(slots=True)
class _EarlyToken:
    """A token a matcher took before its step was processed (advance_early), and what it then said."""

    request: Request
    state: SequenceGrammar
    position: int  # its output position
    token: int
    done: bool  # the grammar accepts nothing more after it (is_done)

    def was_kept(self) -> bool:
        tokens, at = self.request.all_token_ids, len(self.request.prompt_token_ids) + self.position
        return at < len(tokens) and tokens[at] == self.token


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        compile_timeout_s: float,
        cache_mib: float,
    ) -> None:
        if not compile_timeout_s > 0:
            raise ValueError(f"structured_outputs_compile_timeout_s must be > 0, got {compile_timeout_s!r}")
        if not cache_mib > 0:
            raise ValueError(f"structured_outputs_cache_mib must be > 0, got {cache_mib!r}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.compile_timeout_s = compile_timeout_s
        self.cache_bytes = int(cache_mib * 2**20)
        self._pool: GrammarCompilerPool | None = None
        self.compiling: dict[str, _Compiling] = {}  # by group id
        self.grammars: dict[str, Any] = {}  # group id -> its CompiledGrammar (forked samples take it)
        self.sequences: dict[str, SequenceGrammar] = {}  # request id -> its matcher
        self.errors: dict[str, str] = {}  # group id -> the error its final output carries
        self._pending_masks: list[StepMask] = []
        self._roots: dict[str, Request] = {}  # group id -> its first sequence (the one samples fork from)
        self._scratch = None
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher: fills a step's rows on its threads
        self._filler: ThreadPoolExecutor | None = None  # runs the async fills (one at a time, in step order)
        self._filling: list[Future] = []  # fills submitted and maybe not done: no matcher moves until they are
        self._mask_buffers: list[Any] = []  # the last masks' tensors, oldest first (StepMask buffer)
        self._early: dict[str, _EarlyToken] = {}  # request id -> the token its matcher took early (this step)

    @classmethod
    def for_model(cls, tokenizer: Any, model_config: Any, config: Any) -> StructuredOutputManager:
        """From the engine's ModelConfig and EngineConfig (the model's vocab size, EOS ids, the two knobs)."""
        return cls(
            tokenizer,
            model_config.vocab_size,
            tuple(model_config.eos_token_ids),
            config.structured_outputs_compile_timeout_s,
            config.structured_outputs_cache_mib,
        )

    def check_available(self, params: Any) -> None:
        """For SamplingParams carrying structured_outputs: RequestRejected now, before the request is queued, if
        xgrammar or the tokenizer is missing."""
        if params.structured_outputs is not None:
            self.pool  # noqa: B018

    @property
    def pool(self) -> GrammarCompilerPool:
        if self._pool is None:
            if self.tokenizer is None:
                raise RequestRejected("structured_outputs needs the checkpoint's tokenizer; this model folder has none")
            self._pool = GrammarCompilerPool(self.tokenizer, self.vocab_size, self.cache_bytes)
        return self._pool

    # ---- compiles --------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        assert params is not None
        future = self.pool.submit(params)
        self.compiling[request.group_id] = _Compiling(request, future, time.monotonic() + self.compile_timeout_s)

    def has_compiling(self) -> bool:
        return bool(self.compiling)

    @property
    def waiting_requests(self) -> list[Request]:
        """Those still compiling their grammar: waiting as much as the scheduler's queue (admission counts them)."""
        return [item.request for item in self.compiling.values()]

    def poll(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests whose grammar is ready, with their matcher made; (request, error) for those that failed)."""
        ready, failed, now = [], [], time.monotonic()
        too_slow = f"structured_outputs grammar did not compile within {self.compile_timeout_s:g} s"
        for group_id, item in list(self.compiling.items()):
            if item.future.done():
                del self.compiling[group_id]
                error = item.future.exception()
                if error is not None:
                    failed.append((item.request, str(error)))
                    continue
                compiled, seconds = item.future.result()
                if seconds > self.compile_timeout_s:  # however soon it was polled: the limit is the compile's
                    failed.append((item.request, too_slow))
                    continue
                self.grammars[group_id] = compiled
                self.sequences[item.request.request_id] = self._new_sequence(item.request)
                self._roots[group_id] = item.request
                ready.append(item.request)
            elif now >= item.deadline:
                del self.compiling[group_id]
                item.future.cancel()  # a compile already running finishes in the background (its result is cached)
                failed.append((item.request, too_slow))
        return ready, failed

    def admit(self, scheduler: Any, output_processor: Any) -> list[RequestOutput]:
        """Requests whose grammar compiled go to the scheduler; those whose compile failed or timed out finish
        here, never scheduled, with the error in their final output."""
        if not self.compiling:
            return []
        ready, failed = self.poll()
        for request in ready:
            scheduler.add_request(request)
        outputs = []
        for request, error in failed:
            request.status = RequestStatus.FINISHED_ABORTED
            output = output_processor.final_output(request.group_id, cumulative=True)
            output.error = error
            self.forget_group(request.group_id)
            outputs.append(output)
        return outputs

    def wait(self, timeout: float, idle: bool) -> None:
        """With nothing else to do (`idle`), sleep until a compile finishes, one passes its time limit, or
        `timeout`: the engine's loop does not spin on compiles."""
        if not self.compiling or not idle:
            return
        soonest = min(item.deadline for item in self.compiling.values()) - time.monotonic()
        wait([item.future for item in self.compiling.values()], max(0.0, min(timeout, soonest)), FIRST_COMPLETED)

    def discard(self, group_id: str) -> None:
        """An aborted group: forget its compile (if still waiting), its grammar and its sequences' matchers."""
        item = self.compiling.pop(group_id, None)
        if item is not None:
            item.future.cancel()
        self.grammars.pop(group_id, None)
        self.errors.pop(group_id, None)
        self._roots.pop(group_id, None)
        for req_id in [r for r in self.sequences if r == group_id or r.startswith(f"{group_id}#")]:
            del self.sequences[req_id]

    def _new_sequence(self, request: Request) -> SequenceGrammar:
        stops = sorted({*self.eos_token_ids, *request.sampling_params.stop_token_ids})
        if request.sampling_params.ignore_eos:
            stops = sorted(set(request.sampling_params.stop_token_ids))
        return SequenceGrammar(self.grammars[request.group_id], stops, self.vocab_size)

    # ---- after a step ---------------------------------------------------------------------------
    def advance(self, advanced: list[Request]) -> list[tuple[Request, RequestStatus]]:
        """Feed each live structured sequence its new tokens; the finishes this calls for (a grammar done: stopped;
        a token refused: aborted, with the error kept for the group's final output). A matcher that took its token
        early is not touched again (its step's mask may be filling from it): what it said then stands."""
        early, self._early = self._early, {}
        stale = {i for i, e in early.items() if not e.request.is_finished and not e.was_kept()}  # never, in practice
        for request in advanced:  # samples forked this step first, from their parent's matcher before it moves on
            if request.request_id not in self.sequences and request.sampling_params.structured_outputs is not None:
                self.settle()
                self.sequences[request.request_id] = self._fork_for(request)
        live = [r for r in advanced if r.sampling_params.structured_outputs is not None and not r.is_finished]
        rest = [r for r in live if r.request_id not in early or r.request_id in stale]
        if rest or stale:
            self.settle()  # these matchers move now: no fill may read them meanwhile
        for req_id in stale:  # a token its sequence did not keep: the matcher steps back
            early[req_id].state.matcher.rollback(1)
            early[req_id].state.num_accepted -= 1
        states = [self.sequences[r.request_id] for r in rest]
        errors = dict(zip(map(id, rest), SequenceGrammar.feed_all(states, [r.output_token_ids for r in rest])))
        finishes: list[tuple[Request, RequestStatus]] = []
        for request in live:  # in the batch's order, whichever way each was fed
            if id(request) in errors:
                error = errors[id(request)]
                done = error is None and self.sequences[request.request_id].is_done(self._scratch_row())
            else:
                error, done = None, early[request.request_id].done
            if error is not None:
                self.errors.setdefault(request.group_id, error)
                finishes.append((request, RequestStatus.FINISHED_ABORTED))
            elif done:
                request.stop_reason = None
                finishes.append((request, RequestStatus.FINISHED_STOPPED))
        return finishes

    def advance_early(self, output: Any, sampled: dict[str, list]) -> None:
        """Async, before a step's processing, with a launched step's mask waiting for its tokens: the structured
        sequences' matchers take them now and that mask fills at once, so its sampling waits for the matchers
        alone, not for the whole batch's appends, stop checks and reports (the chain vLLM #26866 keeps short).
        Only when each structured row brings one plain next token (not a fan-out's first draws, nor drafts); else
        finish_advanced feeds them in order and the mask fills after. Either way the matchers hold the same tokens
        when the mask fills (a finished sequence's row is dropped), so the masks, and the outputs, are the same."""
        if not self._pending_masks or not self.sequences or output.num_drafts:
            return
        self.settle()
        fed: list[tuple[Request, SequenceGrammar, int]] = []
        for item in output.scheduled:
            request = item.request
            state = self.sequences.get(request.request_id)
            if state is None or request.is_finished or request.epoch != item.epoch:
                continue  # not structured, or its result is dropped (step/post_step.py): its matcher stays
            draws = sampled.get(request.request_id)
            if not draws:
                continue  # a prefill chunk short of its prompt's end
            if len(draws) != 1 or request.fan_out or state.num_accepted != request.num_output_tokens:
                return
            fed.append((request, state, draws[0][0]))
        accepted = SequenceGrammar.accept_next([state for _, state, _ in fed], [token for _, _, token in fed])
        for (request, state, token), ok in zip(fed, accepted):
            if ok:  # a refused one is fed again in order, and names its error then
                done = state.is_done(self._scratch_row())
                self._early[request.request_id] = _EarlyToken(request, state, state.num_accepted - 1, token, done)
        # a sequence whose grammar just ended stops this step: its row stays all-allowed (xgrammar refuses to fill
        # a terminated matcher) and its draw is dropped
        ended = {req_id for req_id, entry in self._early.items() if entry.done}
        self.fill_pending({k: v for k, v in self.sequences.items() if k not in ended} if ended else self.sequences)

    def _fork_for(self, request: Request) -> SequenceGrammar:
        """A sample forked this step (n > 1, best_of): its own matcher, forked from its parent's at the fork point
        (feed() then takes the sample's own token); one replaying its tokens if the parent's is not there."""
        parent = self.sequences.get(request.group_id)
        tokens = request.output_token_ids
        accepted = parent.num_accepted if parent is not None else 0
        if (
            parent is not None
            and accepted < len(tokens)
            and self._parent_tokens(request.group_id)[:accepted] == tokens[:accepted]
        ):
            return parent.fork()
        return self._new_sequence(request)

    def finish_advanced(self, advanced: list[Request], scheduler: Any) -> None:
        """advance(), then the finishes it calls for, then the matchers of every sequence that finished."""
        if not self.sequences:
            self._early.clear()
            return
        for request, status in self.advance(advanced):
            scheduler.finish_request(request, status)
        self.forget_finished(advanced)

    def with_errors(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Final outputs of structured groups carry their error (None if they had none); their grammar is dropped."""
        if self.grammars:
            for output in outputs:
                if output.finished:
                    output.error = self.forget_group(output.request_id)
        return outputs

    def _parent_tokens(self, group_id: str) -> list[int]:
        return self._roots[group_id].output_token_ids if group_id in self._roots else []

    def forget_finished(self, requests: list[Request]) -> None:
        for request in requests:
            if request.is_finished:
                self.sequences.pop(request.request_id, None)

    def forget_group(self, group_id: str) -> str | None:
        """A group that reported its final output: drop what is left of it; the error it carries, if any."""
        error = self.errors.pop(group_id, None)
        self.grammars.pop(group_id, None)
        self._roots.pop(group_id, None)
        return error

    def _scratch_row(self):
        if self._scratch is None:
            from pagedq.engine.structured_output.backend import xgrammar

            self._scratch = xgrammar().allocate_token_bitmask(1, self.vocab_size)
        return self._scratch

    # ---- speculative drafts ----------------------------------------------------------------------
    def cut_drafts(self, request: Request, drafts: tuple[int, ...]) -> tuple[int, ...]:
        """The leading drafts of a structured sequence its grammar accepts (SequenceGrammar.num_valid_drafts), the
        matcher left as it was; a plain request's drafts as they are. None for a matcher behind its tokens."""
        if request.sampling_params.structured_outputs is None or not drafts:
            return drafts
        state = self.sequences.get(request.request_id)
        if state is None or state.num_accepted != request.num_output_tokens:
            return ()
        self.settle()  # no fill of an earlier step may read this matcher while it moves
        return drafts[: state.num_valid_drafts(drafts, self._scratch_row())]

    # ---- the step's mask ----------------------------------------------------------------------------
    def attach(self, step: Any, fill_now: bool) -> None:
        """Give a prepared step (engine.model_runner.PreparedStep) the mask of its structured draws, filled now
        when every token before them is known, else by fill_pending() once the step before it is processed."""
        plan = step.sampling
        if plan is None or not self.sequences:
            return
        rows = [i for i, info in enumerate(plan.infos) if info.req_id in self.sequences]
        if not rows:
            return
        # buffers recycled two masks later: by then that step has finished (at most two are in flight)
        buffer = self._mask_buffers.pop(0) if len(self._mask_buffers) > 2 else None
        drafts = {info.req_id: c.draft_token_ids for c, info in zip(step.ordered, step.infos) if c.draft_token_ids}
        req_ids = [plan.infos[i].req_id for i in rows]
        mask = StepMask(rows, req_ids, len(plan.infos), self.vocab_size, buffer, drafts)
        self._mask_buffers.append(mask.buffer)
        step.constrain = mask.apply
        if fill_now:
            self._fill(mask)
        else:
            self._pending_masks.append(mask)

    def fill_pending(self, matchers: dict[str, SequenceGrammar] | None = None) -> None:
        """The launched steps' masks, on the filler thread: the engine thread goes on to schedule and prepare the
        next step meanwhile (which matcher fills which row is decided here, before the scheduler moves on).
        `matchers`: those that fill (default: every live sequence's)."""
        masks, self._pending_masks = self._pending_masks, []
        if not masks:
            return
        if self._filler is None:
            self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedq-mask")
        batch = self._batch_matcher()
        for mask in masks:
            self._filling.append(
                self._filler.submit(mask.collect(self.sequences if matchers is None else matchers), batch)
            )

    def settle(self) -> None:
        """Wait for the fills in progress (a failed one has already failed its step's device work)."""
        filling, self._filling = self._filling, []
        for future in filling:
            future.exception()

    def _fill(self, mask: StepMask) -> None:
        self.settle()
        mask.fill(self.sequences, self._batch_matcher())

    def _batch_matcher(self) -> Any:
        if self._batch is None:
            from pagedq.engine.structured_output.backend import xgrammar

            # a core left to the engine thread, which schedules the next step while the mask fills
            self._batch = xgrammar().BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) - 1)))
        return self._batch

    def cancel_pending(self) -> None:
        masks, self._pending_masks = self._pending_masks, []
        for mask in masks:
            mask.cancel()

    def close(self) -> None:
        self.cancel_pending()
        self.settle()
        if self._filler is not None:
            self._filler.shutdown(wait=True)
        if self._pool is not None:
            self._pool.close()
