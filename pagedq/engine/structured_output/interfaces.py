"""What the structured-output manager reads of the engine's objects, as Protocols: it sits below sample/, core/,
runner/ and output/ (tests/test_layers.py), so it names none of their classes; the engine's Request, SchedulerOutput
and PreparedStep satisfy these as they are."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeAlias, TypeVar

import torch

from pagedq.engine.structured_output.params import StructuredOutputsParams

# xgrammar's compiled grammar: opaque here, only the matchers made from it read it (xgrammar is imported lazily, by
# backend.py alone, so its classes are not named at module level)
CompiledGrammar: TypeAlias = object


class BatchMatcher(Protocol):
    """xgrammar's BatchGrammarMatcher: fills many matchers' rows of a bitmask on its own threads."""

    def batch_fill_next_token_bitmask(
        self, matchers: Sequence[object], bitmask: torch.Tensor, indices: list[int] | None = None
    ) -> None: ...


class GrammarParams(Protocol):
    """A request's SamplingParams: its constraint, and the tokens that end it (a grammar accepts them at its end)."""

    @property
    def structured_outputs(self) -> StructuredOutputsParams | None: ...

    @property
    def stop_token_ids(self) -> list[int]: ...

    @property
    def ignore_eos(self) -> bool: ...


class GrammarRequest(Protocol):
    """One sequence (core.request.Request): its tokens so far and where it stands."""

    @property
    def request_id(self) -> str: ...

    @property
    def group_id(self) -> str: ...  # its samples (n, best_of) share it, and their grammar

    @property
    def sampling_params(self) -> GrammarParams: ...

    @property
    def is_finished(self) -> bool: ...

    @property
    def epoch(self) -> int: ...  # bumped by a recompute: a step scheduled before it is stale

    @property
    def fan_out(self) -> int: ...  # samples still to fork from it (0 once they are)

    @property
    def later_waves(self) -> Sequence[GrammarRequest]: ...  # its group's other waves of samples (on its first only)

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


R = TypeVar("R", bound=GrammarRequest)


class ScheduledSequence(Protocol):
    """A sequence's share of a step (core's ScheduledRequest): whose, and at which epoch."""

    @property
    def request(self) -> GrammarRequest: ...

    @property
    def epoch(self) -> int: ...


class ProcessedStep(Protocol):
    """A step whose tokens just came back (core's SchedulerOutput)."""

    @property
    def scheduled(self) -> Sequence[ScheduledSequence]: ...

    @property
    def num_drafts(self) -> int: ...


class DrawRow(Protocol):
    """A row of a prepared step (step.batch_state.RowInfo)."""

    @property
    def req_id(self) -> str: ...


class DrawPlan(Protocol):
    """A step's draws (step.batch_state.SamplingPlan): the row each draw samples, in draw order."""

    @property
    def infos(self) -> Sequence[DrawRow]: ...


class DraftedChunk(Protocol):
    """A scheduled chunk of a prepared step: the speculative drafts it verifies."""

    @property
    def draft_token_ids(self) -> tuple[int, ...]: ...


class LaunchedStep(Protocol):
    """A prepared step about to launch (runner.model_runner.PreparedStep)."""

    @property
    def sampling(self) -> DrawPlan | None: ...

    @property
    def ordered(self) -> Sequence[DraftedChunk]: ...  # its chunks, row by row with `infos`

    @property
    def infos(self) -> Sequence[DrawRow]: ...
