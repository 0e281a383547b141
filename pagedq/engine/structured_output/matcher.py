"""One grammar matcher per sequence: it accepts each token the sequence keeps and fills that sequence's mask rows."""

from __future__ import annotations

from typing import Any

import torch

from pagedq.engine.structured_output.backend import xgrammar


class SequenceGrammar:
    def __init__(self, compiled: Any, stop_token_ids: list[int], vocab_size: int) -> None:
        xgr = xgrammar()
        # The stop ids end the grammar: EOS and the request's stop_token_ids, allowed once the output is complete.
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self.compiled = compiled
        self.stop_token_ids = stop_token_ids
        self.vocab_size = vocab_size
        self.num_accepted = 0  # output tokens the matcher has seen

    def fork(self) -> SequenceGrammar:
        """A matcher in this one's state, for a sample forked from its sequence (xgrammar's fork)."""
        twin = SequenceGrammar.__new__(SequenceGrammar)
        twin.__dict__.update(self.__dict__)
        twin.matcher = self.matcher.fork()
        return twin

    def feed(self, output_token_ids: list[int]) -> str | None:
        """Accept the output tokens not seen yet; an error naming the first token the grammar refuses."""
        for position in range(self.num_accepted, len(output_token_ids)):
            token = output_token_ids[position]
            if not self.matcher.accept_token(token):
                return _refused(token, position)
            self.num_accepted = position + 1
        return None

    @staticmethod
    def feed_all(states: list[SequenceGrammar], outputs: list[list[int]]) -> list[str | None]:
        """feed() for many sequences; those with one unseen token (a decode step's) in one xgrammar call: a call
        per sequence gives up the GIL each time (docs/benchmarks-log.md#why-the-mask-was-slow)."""
        errors: list[str | None] = [None] * len(states)
        single = [i for i, (state, tokens) in enumerate(zip(states, outputs)) if len(tokens) == state.num_accepted + 1]
        if len(single) < 2:
            single = []
        accepted = SequenceGrammar.accept_next([states[i] for i in single], [outputs[i][-1] for i in single])
        for i, ok in zip(single, accepted):
            if not ok:
                errors[i] = _refused(outputs[i][-1], states[i].num_accepted)
        fed = set(single)
        for i, (state, tokens) in enumerate(zip(states, outputs)):
            if i not in fed:
                errors[i] = state.feed(tokens)
        return errors

    @staticmethod
    def accept_next(states: list[SequenceGrammar], tokens: list[int]) -> list[bool]:
        """Each matcher takes one next token (each in step with its sequence's outputs before it); whether it did.
        A refused token leaves its matcher as it was (feed() then names the error)."""
        if not states:
            return []
        if len(states) == 1:
            accepted = [states[0].matcher.accept_token(tokens[0])]
        else:
            accepted = xgrammar().BatchGrammarMatcher.batch_accept_token([s.matcher for s in states], tokens)
        for state, ok in zip(states, accepted):
            state.num_accepted += bool(ok)
        return [bool(ok) for ok in accepted]

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def num_valid_drafts(self, drafts: tuple[int, ...], scratch: torch.Tensor) -> int:
        """How many leading drafts a speculative step may verify, the matcher left as it was: those the grammar
        accepts, stopping before one that finishes it (is_done). Only the step's last emitted token may finish the
        grammar, as in a plain step, where the request stops right after that token (nothing is drawn past it)."""
        accepted = kept = 0
        for token in drafts:
            if not self.matcher.accept_token(token):
                break
            accepted += 1
            if self.is_done(scratch):
                break
            kept = accepted
        if accepted:
            self.matcher.rollback(accepted)
        return kept

    def fill_verify_rows(self, bitmask: torch.Tensor, rows: list[int], drafts: tuple[int, ...]) -> None:
        """A verify row's masks: row j (of len(drafts) + 1) is the mask after drafts[:j], as a plain step would fill
        it at that output position; the matcher is rolled back after. The drafts passed num_valid_drafts."""
        accepted = 0
        try:
            for j, row in enumerate(rows):
                self.matcher.fill_next_token_bitmask(bitmask, row)
                if j < len(drafts):
                    if not self.matcher.accept_token(drafts[j]):
                        raise RuntimeError(f"draft {drafts[j]} refused by the grammar it passed (an engine bug)")
                    accepted += 1
        finally:
            if accepted:
                self.matcher.rollback(accepted)

    def is_done(self, scratch: torch.Tensor) -> bool:
        """The grammar accepts nothing more: it saw a stop token, or it is complete and allows only stop tokens
        (then the request stops here, even before min_tokens: EOS wins, vLLM #53665)."""
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():
            return False
        self.matcher.fill_next_token_bitmask(scratch, 0)
        row = scratch[0].clone()
        for token in self.stop_token_ids:
            if token < self.vocab_size:
                row[token // 32] &= ~(1 << (token % 32))
        return not bool(row.any())


def _refused(token: int, position: int) -> str:
    return f"output token {token} at position {position} does not match the structured_outputs grammar"
