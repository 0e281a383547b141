"""Speculative decoding: drafts proposed from each sequence's own history, verified exactly by the target model.

    config.py   SpeculativeConfig: vLLM's `speculative_config` (method "ngram", num_speculative_tokens, ...)
    ngram.py    NgramProposer: prompt lookup, incremental per request
    drafts.py   Speculation: the engine's side (which rows draft, how many, lookahead KV blocks, the figures)
    verify.py   the runner's side: acceptance on the device (where verify rows draw: engine/step/draws.py)

The design and its exactness argument: docs/engine.md, "Speculative decoding".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """What the engine asks of a draft proposer, per request id (pagedq/engine/spec_decode/ngram.py is one)."""

    def add_request(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Start tracking a request: its full history (prompt + outputs so far)."""

    def append(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Tokens of a tracked request that became final since."""

    def fork(self, parent_id: str, child_id: str) -> None:
        """A sample sharing the parent's history (n > 1)."""

    def remove(self, req_id: str) -> None:
        """Forget a request."""

    def propose(self, req_id: str, max_drafts: int) -> list[int]:
        """Up to max_drafts next tokens (fewer, or none, when the history offers no match)."""
