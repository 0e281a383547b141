"""What the engine drives for structured outputs: requests waiting for their grammar, one matcher per sequence,
and the per-step masks. The engine meets it in four phases a step, data in and out; it finishes no request itself.

    admit()    before scheduling: the requests whose grammar compiled (for the scheduler) and those whose compile
               failed or timed out (with the error the engine finishes them with); waits a little when idle
    launch()   a prepared step's mask over its structured draws (None: the step never waits), filled now when
               every token before it is known, else once the step in flight is processed (the MaskFiller)
    result     take_early() before the step's post-processing (async: the matchers take the new tokens first and
               the launched step's mask fills at once); advance() after it: the matchers take the rest, and the
               finishes that calls for and the errors of the groups it is done with come back
    failed()   a step failed: the masks waiting for it are cancelled (their steps are recomputed), or, if only its
               processing failed, filled from the matchers as they stand
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic

import torch

from pagedq.engine.errors import RequestRejected
from pagedq.engine.structured_output.compiler import ConversionCheck, GrammarCompilerPool
from pagedq.engine.structured_output.filler import MaskFiller
from pagedq.engine.structured_output.interfaces import (
    CompiledGrammar,
    GrammarParams,
    GrammarRequest,
    LaunchedStep,
    ProcessedStep,
    R,
)
from pagedq.engine.structured_output.matcher import SequenceGrammar

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedTokenizerBase


@dataclass
class _Compiling(Generic[R]):
    request: R
    future: Future
    deadline: float


@dataclass
class Admission(Generic[R]):
    """What admit() hands the engine: requests whose grammar is ready (for the scheduler), and those that fail
    before they run, with the error their final output carries."""

    ready: list[R] = field(default_factory=list)
    failed: list[tuple[R, str]] = field(default_factory=list)


@dataclass
class GrammarVerdict(Generic[R]):
    """What advance() hands the engine. `finishes`, in the batch's order: each sequence to finish, with None when
    its grammar is complete (it stops) or the error of the token its grammar refused (it is aborted). `errors`: the
    groups the manager is done with (every sequence finished) that carry an error, for their final outputs."""

    finishes: list[tuple[R, str | None]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _EarlyToken:
    """A token a matcher took before its step was processed (take_early), and what it then said."""

    request: GrammarRequest
    state: SequenceGrammar
    position: int  # its output position
    token: int
    done: bool  # the grammar accepts nothing more after it (is_done)

    def was_kept(self) -> bool:
        tokens, at = self.request.all_token_ids, len(self.request.prompt_token_ids) + self.position
        return at < len(tokens) and tokens[at] == self.token


class StructuredOutputManager(Generic[R]):
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
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
        self.compiling: dict[str, _Compiling[R]] = {}  # by group id
        self.grammars: dict[str, CompiledGrammar] = {}  # group id -> its grammar (forked samples take it)
        self.sequences: dict[str, SequenceGrammar] = {}  # request id -> its matcher
        self.errors: dict[str, str] = {}  # group id -> the error its final output carries
        self._roots: dict[str, GrammarRequest] = {}  # group id -> its first sequence (the one samples fork from)
        self._num_live: dict[str, int] = {}  # group id -> how many of its sequences hold a matcher
        self._scratch: torch.Tensor | None = None
        self._early: dict[str, _EarlyToken] = {}  # request id -> the token its matcher took early (this step)
        self.filler = MaskFiller(vocab_size)
        self.check_converts = ConversionCheck()  # at add_request, on the caller's thread (compiler.check_converts)

    def check_available(self, params: GrammarParams) -> None:
        """For SamplingParams carrying structured_outputs: RequestRejected now, before the request is queued, if
        xgrammar or the tokenizer is missing, or if the spec does not convert to a grammar (compiler.check_converts)."""
        if params.structured_outputs is not None:
            self.pool  # noqa: B018
            self.check_converts(params.structured_outputs)

    @property
    def pool(self) -> GrammarCompilerPool:
        if self._pool is None:
            if self.tokenizer is None:
                raise RequestRejected("structured_outputs needs the checkpoint's tokenizer; this model folder has none")
            self._pool = GrammarCompilerPool(self.tokenizer, self.vocab_size, self.cache_bytes)
        return self._pool

    # ---- compiles --------------------------------------------------------------------------------
    def submit(self, request: R) -> None:
        """The request's grammar starts compiling, behind its source's other compiles (compiler.py); the request
        waits here, not in the scheduler."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        future = self.pool.submit(params, params.compile_source)
        self.compiling[request.group_id] = _Compiling(request, future, time.monotonic() + self.compile_timeout_s)

    def has_compiling(self) -> bool:
        return bool(self.compiling)

    @property
    def waiting_requests(self) -> list[R]:
        """Those still compiling their grammar: waiting as much as the scheduler's queue (admission counts them)."""
        return [item.request for item in self.compiling.values()]

    def admit(self, idle: bool) -> Admission[R]:
        """Phase 1, before scheduling. With nothing else to do (`idle`), first sleep until a compile finishes or
        passes its time limit (at most 50 ms): the engine's loop does not spin on compiles. Then the requests whose
        grammar is ready, with their matcher made, and those whose compile failed or took too long."""
        admission: Admission[R] = Admission()
        if not self.compiling:
            return admission
        if idle:
            soonest = min(item.deadline for item in self.compiling.values()) - time.monotonic()
            wait([item.future for item in self.compiling.values()], max(0.0, min(0.05, soonest)), FIRST_COMPLETED)
        now = time.monotonic()
        too_slow = f"structured_outputs grammar did not compile within {self.compile_timeout_s:g} s"
        for group_id, item in list(self.compiling.items()):
            if item.future.done():
                del self.compiling[group_id]
                error = item.future.exception()
                if error is not None:
                    admission.failed.append((item.request, str(error)))
                    continue
                compiled, seconds = item.future.result()
                if seconds > self.compile_timeout_s:  # however soon it was polled: the limit is the compile's
                    admission.failed.append((item.request, too_slow))
                    continue
                self.grammars[group_id] = compiled
                self._roots[group_id] = item.request
                waves: list[GrammarRequest] = [item.request, *item.request.later_waves]
                for wave in waves:  # each wave of its samples starts with a fresh matcher
                    self._add_sequence(wave, self._new_sequence(wave))
                admission.ready.append(item.request)
            elif now >= item.deadline:
                del self.compiling[group_id]
                item.future.cancel()  # one already running goes on, counted against its source (compiler.py)
                admission.failed.append((item.request, too_slow))
        return admission

    def discard(self, group_id: str) -> None:
        """An aborted group: forget its compile (if still waiting), its grammar and its sequences' matchers."""
        item = self.compiling.pop(group_id, None)
        if item is not None:
            item.future.cancel()
        for req_id in [r for r in self.sequences if r == group_id or r.startswith(f"{group_id}#")]:
            del self.sequences[req_id]
        self._forget_group(group_id)

    def _new_sequence(self, request: GrammarRequest) -> SequenceGrammar:
        stops = sorted({*self.eos_token_ids, *request.sampling_params.stop_token_ids})
        if request.sampling_params.ignore_eos:
            stops = sorted(set(request.sampling_params.stop_token_ids))
        return SequenceGrammar(self.grammars[request.group_id], stops, self.vocab_size)

    def _add_sequence(self, request: GrammarRequest, state: SequenceGrammar) -> None:
        self.sequences[request.request_id] = state
        self._num_live[request.group_id] = self._num_live.get(request.group_id, 0) + 1

    def _forget_group(self, group_id: str) -> str | None:
        """The group is done here: drop what is left of it; the error its final output carries, if any."""
        self.grammars.pop(group_id, None)
        self._roots.pop(group_id, None)
        self._num_live.pop(group_id, None)
        return self.errors.pop(group_id, None)

    # ---- the step's mask (phase 2) --------------------------------------------------------------------
    def launch(self, step: LaunchedStep, fill_now: bool) -> Callable[[torch.Tensor], None] | None:
        """The mask of a prepared step's structured draws, as what masks its logits before sampling (the step's
        `constrain`); None for a step without any. Filled now when every token before them is known (`fill_now`),
        else once the step before it is processed (take_early or advance)."""
        plan = step.sampling
        if plan is None or not self.sequences:
            return None
        rows = [i for i, info in enumerate(plan.infos) if info.req_id in self.sequences]
        if not rows:
            return None
        drafts = {info.req_id: c.draft_token_ids for c, info in zip(step.ordered, step.infos) if c.draft_token_ids}
        mask = self.filler.new_mask(rows, [plan.infos[i].req_id for i in rows], len(plan.infos), drafts)
        if fill_now:
            self.filler.fill_now(mask, self.sequences)
        else:
            self.filler.defer(mask)
        return mask.apply

    # ---- after a step (phase 3) -----------------------------------------------------------------------
    def take_early(self, output: ProcessedStep, sampled: dict[str, list]) -> None:
        """Async, before a step's processing, with a launched step's mask waiting for its tokens: the structured
        sequences' matchers take them now and that mask fills at once, so its sampling waits for the matchers
        alone, not for the whole batch's appends, stop checks and reports (the chain vLLM #26866 keeps short).
        Only when each structured row brings one plain next token (not a fan-out's first draws, nor drafts); else
        advance() feeds them in order and the mask fills after. Either way the matchers hold the same tokens when
        the mask fills (a finished sequence's row is dropped), so the masks, and the outputs, are the same."""
        if not self.filler.pending or not self.sequences or output.num_drafts:
            return
        self.filler.settle()
        fed: list[tuple[GrammarRequest, SequenceGrammar, int]] = []
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
        filling = {k: v for k, v in self.sequences.items() if k not in ended} if ended else self.sequences
        self.filler.fill_pending(filling)

    def advance(self, advanced: list[R]) -> GrammarVerdict[R]:
        """Feed each live structured sequence its new tokens; the finishes this calls for (a grammar done: stopped;
        a token refused: aborted, its error kept for the group's final output). A matcher that took its token
        early is not touched again (its step's mask may be filling from it): what it said then stands. Then the
        matchers of the sequences that finish are dropped, and the launched step's mask may fill."""
        verdict: GrammarVerdict[R] = GrammarVerdict()
        early, self._early = self._early, {}
        if not self.sequences:  # (a launched step's mask may outlive its sequences: an abort)
            self.filler.fill_pending(self.sequences)
            return verdict
        stale = {i for i, e in early.items() if not e.request.is_finished and not e.was_kept()}  # never, in practice
        for request in advanced:  # samples forked this step first, from their parent's matcher before it moves on
            if request.request_id not in self.sequences and request.sampling_params.structured_outputs is not None:
                self.filler.settle()
                self._add_sequence(request, self._fork_for(request))
        live = [r for r in advanced if r.sampling_params.structured_outputs is not None and not r.is_finished]
        rest = [r for r in live if r.request_id not in early or r.request_id in stale]
        if rest or stale:
            self.filler.settle()  # these matchers move now: no fill may read them meanwhile
        for req_id in stale:  # a token its sequence did not keep: the matcher steps back
            early[req_id].state.matcher.rollback(1)
            early[req_id].state.num_accepted -= 1
        states = [self.sequences[r.request_id] for r in rest]
        errors = dict(zip(map(id, rest), SequenceGrammar.feed_all(states, [r.output_token_ids for r in rest])))
        finishing: set[str] = set()
        for request in live:  # in the batch's order, whichever way each was fed
            if id(request) in errors:
                error = errors[id(request)]
                done = error is None and self.sequences[request.request_id].is_done(self._scratch_row())
            else:
                error, done = None, early[request.request_id].done
            if error is not None:
                self.errors.setdefault(request.group_id, error)
            if error is not None or done:
                verdict.finishes.append((request, error))
                finishing.add(request.request_id)
        for request in advanced:
            if (request.is_finished or request.request_id in finishing) and self._drop_sequence(request):
                error = self._forget_group(request.group_id)
                if error is not None:
                    verdict.errors[request.group_id] = error
        self.filler.fill_pending(self.sequences)
        return verdict

    def _drop_sequence(self, request: GrammarRequest) -> bool:
        """Forget a finished sequence's matcher; whether its group is then done here (no sequence left, none to
        fork)."""
        if self.sequences.pop(request.request_id, None) is None:
            return False
        group_id = request.group_id
        self._num_live[group_id] -= 1
        root = self._roots.get(group_id)
        return self._num_live[group_id] == 0 and (root is None or not root.fan_out)

    def _fork_for(self, request: GrammarRequest) -> SequenceGrammar:
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

    def _parent_tokens(self, group_id: str) -> list[int]:
        return self._roots[group_id].output_token_ids if group_id in self._roots else []

    def _scratch_row(self) -> torch.Tensor:
        if self._scratch is None:
            from pagedq.engine.structured_output.backend import xgrammar

            self._scratch = xgrammar().allocate_token_bitmask(1, self.vocab_size)
        return self._scratch

    # ---- a failed step (phase 4) ------------------------------------------------------------------------
    def failed(self, recompute: bool) -> None:
        """A step failed. On the device (`recompute`: its requests are recomputed): the masks waiting for its tokens
        are cancelled, so their steps stop at their sampling (StepCancelled) and are recomputed too, rather than
        wait. In its processing on the host: they fill from the matchers as they stand, so the launched step ends."""
        if recompute:
            self.filler.cancel_pending()
        else:
            self.filler.fill_pending(self.sequences)

    # ---- speculative drafts ----------------------------------------------------------------------
    def cut_drafts(self, request: GrammarRequest, drafts: tuple[int, ...]) -> tuple[int, ...]:
        """The leading drafts of a structured sequence its grammar accepts (SequenceGrammar.num_valid_drafts), the
        matcher left as it was; a plain request's drafts as they are. None for a matcher behind its tokens."""
        if request.sampling_params.structured_outputs is None or not drafts:
            return drafts
        state = self.sequences.get(request.request_id)
        if state is None or state.num_accepted != request.num_output_tokens:
            return ()
        self.filler.settle()  # no fill of an earlier step may read this matcher while it moves
        return drafts[: state.num_valid_drafts(drafts, self._scratch_row())]

    def close(self) -> None:
        self.filler.close()
        if self._pool is not None:
            self._pool.close()
