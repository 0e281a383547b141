"""The engine's side of speculative decoding: which sequences draft this step, how many tokens, their KV slots.

A decoding sequence whose tokens are all known (no draw of it still in flight) asks its proposer for up to k drafts,
capped so that the step can never run past max_tokens or the model's length, nor past the step's token budget. Its
row then brings 1 + d tokens (the last token and the drafts) and its lookahead slots are allocated with the rest, but
only from blocks to spare: a draft never preempts anyone, and leaves a free block per running sequence.

Drafts are never registered in the prefix cache: blocks are hashed over final tokens only (Scheduler._scheduled), and
after the step the sequence's computed count and its block table are cut back to what verification accepted
(pagedq/engine/step/post_step.py), so a rejected draft's slot is never counted as computed and is overwritten later.

The per-step verify budget (`wants_drafts`): speculation pays while a step is bound by its fixed per-step cost, and
costs once verifying 1 + d tokens per row makes the forward wider than the batch alone would. So a step's verify
tokens stay within `max_verify_tokens`: with R sequences running each drafts at most max_verify_tokens // R - 1
(within k), and where that is under one the step runs as a plain decode (docs/engine.md has the measurement). One
configuration then drafts long at batch 1, shorter at batch 16 and not at all at batch 64.
And a step that proposes gives up its overlap with the step in flight (async scheduling), so after a step whose
proposals all came back empty, the next ones run without drafts, backing off exponentially.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from pagedq.engine.core.block_manager import BlockManager
from pagedq.engine.core.request import Request, SampledToken, ScheduledRequest
from pagedq.engine.spec_decode import Proposer

if TYPE_CHECKING:
    from pagedq.engine.config.speculative import SpeculativeConfig


class DraftGrammar(Protocol):
    """What cuts a structured sequence's drafts to those its grammar accepts (the StructuredOutputManager)."""

    def cut_drafts(self, request: Request, drafts: tuple[int, ...]) -> tuple[int, ...]: ...


# A step's verify tokens at most (running sequences x (1 + drafts each)): long drafts pay alone, short ones in
# company, and none in a large batch (docs/benchmarks.md#speculative-decoding). With k = 8: eight drafts a row up to
# batch 8, 4 at batch 16, 1 at batch 27-40, none from batch 41 on.
DEFAULT_MAX_VERIFY_TOKENS = 80
# A step that asked the proposer and got no draft for anyone gave up its overlap with the step before it for nothing:
# the next 1, 2, 4, ... (at most this many) steps then run without drafts, pipelined; a step with drafts resets it.
# That pays where the host's work a step is a real share of the step (a GPU); on the CPU the overlap is a small
# share of a step and the skipped steps lose the drafts they would have found, so the engine turns it off there
# (max_backoff_steps 0; docs/benchmarks.md#speculative-decoding).
MAX_BACKOFF_STEPS = 8


def default_backoff_steps(device: str) -> int:
    return 0 if device == "cpu" else MAX_BACKOFF_STEPS


def next_draft_limit(num_drafts: int, num_accepted: int, k: int) -> int:
    """A request's most drafts at its next verify, from its last one: as many as just held plus one after a
    rejection (a draft past the first wrong one is wasted work: on a CPU a verify row's tokens cost nearly what
    prefill tokens do), two more after a full acceptance, within [1, k]. The outputs never depend on it: greedy
    tokens are the target's whatever is drafted, and sampling keeps the target's distribution."""
    grown = num_accepted + (2 if num_accepted == num_drafts else 1)
    return max(1, min(k, grown))


class Speculation:
    def __init__(
        self,
        proposer: Proposer,
        num_speculative_tokens: int,
        vocab_size: int,
        max_model_len: int,
        max_verify_tokens: int = DEFAULT_MAX_VERIFY_TOKENS,
        grammar: DraftGrammar | None = None,
        max_backoff_steps: int = MAX_BACKOFF_STEPS,
    ) -> None:
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int):
            raise ValueError(f"num_speculative_tokens must be an integer, got {num_speculative_tokens!r}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if isinstance(max_verify_tokens, bool) or not isinstance(max_verify_tokens, int) or max_verify_tokens < 1:
            raise ValueError(f"max_verify_tokens must be a positive integer, got {max_verify_tokens!r}")
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_verify_tokens = max_verify_tokens
        self.max_backoff_steps = max_backoff_steps  # 0: every step the verify budget allows asks the proposer
        self.grammar = grammar  # None: structured requests get no drafts
        self._known: dict[str, int] = {}  # request id -> tokens of its history the proposer has
        self._limits: dict[str, int] = {}  # request id -> most drafts at its next verify (next_draft_limit)
        self._groups: dict[str, str] = {}  # group id of an n > 1 request -> the proposer's id of its prompt history
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_draft_tokens = 0  # of which accepted
        self.num_grammar_cut_draft_tokens = 0  # proposed, then cut by a structured request's grammar (not verified)
        self.num_verify_rows = 0  # row-steps that carried at least one draft
        self.num_off_steps = 0  # steps run without drafts (the verify budget, or the back-off)
        self._asked = self._found = 0  # this step's sequences that asked the proposer, and those it gave drafts
        self._backoff = self._skip = 0
        self._row_cap = num_speculative_tokens  # most drafts a row this step (wants_drafts)

    @classmethod
    def from_config(
        cls,
        config: SpeculativeConfig,
        vocab_size: int,
        max_model_len: int,
        grammar: DraftGrammar | None = None,
        max_backoff_steps: int = MAX_BACKOFF_STEPS,
    ) -> Speculation:
        """From a parsed SpeculativeConfig (pagedq/engine/config/speculative.py)."""
        from pagedq.engine.spec_decode.ngram import NgramProposer

        if config.method != "ngram":
            raise ValueError(f"speculative_config method must be 'ngram', got {config.method!r}")
        k = config.num_speculative_tokens
        return cls(
            NgramProposer(config), k, vocab_size, max_model_len, grammar=grammar, max_backoff_steps=max_backoff_steps
        )

    def stats(self) -> dict[str, float]:
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "num_grammar_cut_draft_tokens": self.num_grammar_cut_draft_tokens,
            "num_verify_rows": self.num_verify_rows,
            "num_spec_off_steps": self.num_off_steps,
        }

    # ---- per step ------------------------------------------------------------------------------------
    def wants_drafts(self, running: Sequence[Request]) -> bool:
        """Whether this step proposes drafts, and at most how many a row (the verify budget above); forgets
        requests that left."""
        if len(self._known) > len(running) or self._groups:
            self._forget_left(running)
        row_cap = min(self.num_speculative_tokens, self.max_verify_tokens // max(1, len(running)) - 1)
        if self._skip or row_cap < 1:
            self._skip = max(0, self._skip - 1)
            self.num_off_steps += 1
            return False
        self._row_cap = row_cap
        self._asked = self._found = 0
        return True

    def after_schedule(self) -> None:
        """After a step scheduled with drafts wanted: back off if the proposer found none for anyone it was asked."""
        if self._found:
            self._backoff = 0
        elif self._asked:
            self._backoff = min(2 * self._backoff or 1, self.max_backoff_steps)
            self._skip = self._backoff

    def lookahead(self, request: Request, budget: int, manager: BlockManager, reserve: int) -> tuple[int, ...]:
        """Drafts for a running sequence scheduled for one token, with their KV slots allocated; () for none.
        `budget`: tokens the step has left; `reserve`: free blocks to leave for the sequences still to schedule."""
        if not self.may_draft(request):
            return ()
        params = request.sampling_params
        num_tokens = request.num_tokens
        limit = min(
            self._limits.get(request.request_id, self.num_speculative_tokens),
            self._row_cap,  # this step's share of the verify budget
            budget,
            params.max_tokens - request.num_output_tokens - 1,  # the step emits at most 1 + d tokens
            self.max_model_len - num_tokens - 1,
        )
        if limit <= 0:
            return ()
        drafts = self._propose(request, limit)
        self._asked += 1
        if drafts and request.sampling_params.structured_outputs is not None and self.grammar is not None:
            valid = self.grammar.cut_drafts(request, drafts)  # before their slots: a cut draft is never verified
            self.num_grammar_cut_draft_tokens += len(drafts) - len(valid)
            drafts = valid
        if not drafts:
            return ()
        self._found += 1
        start = request.num_computed_tokens
        end = start + 1 + len(drafts)
        extra = manager.blocks_for_tokens(end) - len(manager.block_table(request.request_id))
        if extra > 0 and manager.num_free_blocks - extra < reserve:
            return ()
        if manager.allocate_slots(request.request_id, start, end) != []:  # its one block written is its own now
            raise RuntimeError(f"lookahead slots of {request.request_id} needed a copy-on-write (an engine bug)")
        return drafts

    def may_draft(self, request: Request) -> bool:
        """A decoding sequence with every token known: not a beam, nor one still to fan out, nor one whose last draw
        is still in flight; a structured one only with a grammar to cut its drafts (docs/engine.md)."""
        return (
            not request.num_placeholders
            and request.num_computed_tokens == request.num_tokens - 1
            and not request.is_beam
            and not request.fan_out
            and (self.grammar is not None or request.sampling_params.structured_outputs is None)
        )

    def _propose(self, request: Request, limit: int) -> tuple[int, ...]:
        req_id, tokens = request.request_id, request.all_token_ids
        known = self._known.get(req_id)
        if known is None:
            self._start(request)
        elif known < len(tokens):
            self.proposer.append(req_id, tokens[known:])
        self._known[req_id] = len(tokens)
        drafts = []
        for token in self.proposer.propose(req_id, limit)[:limit]:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                break  # a proposer's bad token would reach the embedding: keep the drafts before it
            drafts.append(token)
        return tuple(drafts)

    def _start(self, request: Request) -> None:
        """Hand the proposer a request it does not track yet. A sample of a request with n > 1 forks the group's
        prompt history (added once for the group, kept while any of its samples runs) and adds only its own
        outputs: each sample proposes from its own history, and the prompt's index is built and held once."""
        req_id, tokens = request.request_id, request.all_token_ids
        if request.sampling_params.num_samples <= 1:
            self.proposer.add_request(req_id, tokens)
            return
        shared = self._groups.get(request.group_id)
        if shared is None:
            shared = self._groups[request.group_id] = f"{request.group_id}\x00prompt"
            self.proposer.add_request(shared, request.prompt_token_ids)
        self.proposer.fork(shared, req_id)
        self.proposer.append(req_id, tokens[len(request.prompt_token_ids) :])

    def _forget_left(self, running: Sequence[Request]) -> None:
        """Forget the requests that left (finished, aborted, preempted) and the groups none of whose samples runs."""
        live = {r.request_id for r in running}
        for req_id in [r for r in self._known if r not in live]:
            del self._known[req_id]
            self._limits.pop(req_id, None)
            self.proposer.remove(req_id)
        if self._groups:
            groups = {r.group_id for r in running}
            for group_id in [g for g in self._groups if g not in groups]:
                self.proposer.remove(self._groups.pop(group_id))

    def record_step(self, scheduled: Sequence[ScheduledRequest], sampled: dict[str, list[SampledToken]]) -> None:
        """Count a step's verify rows and what verification kept of their drafts."""
        for item in scheduled:
            if item.draft_token_ids and (draws := sampled.get(item.request.request_id)):
                self.num_verify_rows += 1
                self.num_draft_tokens += len(item.draft_token_ids)
                self.num_accepted_draft_tokens += len(draws) - 1
                limit = next_draft_limit(len(item.draft_token_ids), len(draws) - 1, self.num_speculative_tokens)
                self._limits[item.request.request_id] = limit
