"""Beam search inside continuous batching, with transformers' selection rules.

Each live beam is an ordinary sequence in the scheduler, marked `is_beam`: its step computes logits and
stores its top candidates instead of appending a token. Once every live beam of a group holds its
candidates, the group selects (as transformers' `generate(num_beams=w)` does): the best K = w * (1 + #eos)
continuations over all beams; those that end (EOS, or the length limit) and rank in the top w enter the
finished pool with score logprob / length**length_penalty; the best w others continue. A parent chosen
several times is forked (its blocks shared, copy-on-write later); a parent chosen by nobody is freed at
once. Beams of many prompts share each step's batch with every other request.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pagedq.engine.core.request import Request, RequestStatus, SampledToken
from pagedq.engine.errors import RequestRejected
from pagedq.engine.output.outputs import CompletionOutput, RequestOutput
from pagedq.engine.sample.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as transformers

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise RequestRejected(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestRejected(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.early_stopping not in (True, False, "never"):
            raise RequestRejected(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    token_ids: list[int]  # generated tokens only
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty: what beams are ranked by
    text: str = ""
    finish_reason: str = "length"


@dataclass
class BeamSearchOutput:
    request_id: str
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class BeamGroup:
    request_id: str
    params: BeamSearchParams
    eos_token_ids: tuple[int, ...]
    prompt_token_ids: list[int]
    live: list[Request]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    improvable: bool = True  # transformers' early-stop heuristic, still unsatisfied

    @property
    def num_candidates(self) -> int:
        num_eos = 0 if self.params.ignore_eos else len(self.eos_token_ids)
        return self.params.beam_width * max(2, 1 + num_eos)

    def ready(self) -> bool:
        return all(beam.beam_candidates is not None for beam in self.live)


class BeamSearchManager:
    """Owns the beam groups; runs selection for every group whose live beams all hold candidates."""

    def __init__(self, scheduler, tokenizer) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.groups: dict[str, BeamGroup] = {}
        self._ids = itertools.count()

    def add(self, root: Request, params: BeamSearchParams, eos_token_ids: tuple[int, ...]) -> None:
        group = BeamGroup(root.request_id, params, eos_token_ids, root.prompt_token_ids, [root])
        root.sampling_params = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        # Set past validation: a wide beam takes more candidates than a request may ask logprobs for
        root.sampling_params.logprobs = group.num_candidates
        root.is_beam = True
        self.groups[root.request_id] = group
        self.scheduler.add_request(root)

    def abort(self, request_id: str) -> RequestOutput | None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for beam in group.live:
            self.scheduler.finish_request(beam, RequestStatus.FINISHED_ABORTED)
        return self._output(group, group.finished, finish_reason="abort")

    def step(self) -> list[RequestOutput]:
        outputs = []
        for group in [g for g in self.groups.values() if g.ready()]:
            if self._select(group):
                del self.groups[group.request_id]
                outputs.append(self._output(group, group.finished))
        return outputs

    def _select(self, group: BeamGroup) -> bool:
        """One transformers beam step for a group; True when the group is done."""
        width, params = group.params.beam_width, group.params
        candidates = sorted(
            (
                (beam.cumulative_logprob + logprob, index, token)
                for index, beam in enumerate(group.live)
                for token, logprob in _candidates(beam).items()
            ),
            key=lambda c: (-c[0], c[1], c[2]),
        )[: group.num_candidates]
        length = group.live[0].num_output_tokens + 1  # generated length after this token
        ends = [
            (not params.ignore_eos and token in group.eos_token_ids) or length >= params.max_tokens
            for _, _, token in candidates
        ]
        can_finish = group.improvable and not (len(group.finished) == width and params.early_stopping is True)
        if can_finish:
            for rank, ((score, index, token), end) in enumerate(zip(candidates, ends)):
                if rank < width and end:
                    tokens = [*group.live[index].output_token_ids, token]
                    reason = "length" if length >= params.max_tokens else "stop"
                    group.finished.append(
                        BeamSearchSequence(tokens, score, score / length**params.length_penalty, finish_reason=reason)
                    )
            group.finished = sorted(group.finished, key=lambda s: -s.score)[:width]
        continuing = [c for c, end in zip(candidates, ends) if not end][:width]
        self._update_improvable(group, continuing, length)
        done = not group.improvable or (len(group.finished) == width and params.early_stopping is True) or all(ends)
        if done:
            for beam in group.live:
                self.scheduler.finish_request(beam, RequestStatus.FINISHED_STOPPED)
            group.live = []
        else:
            self._advance(group, continuing)
        return done

    @staticmethod
    def _update_improvable(group: BeamGroup, continuing: list, length: int) -> None:
        params = group.params
        if not continuing:
            return
        best_length = params.max_tokens if params.early_stopping == "never" and params.length_penalty > 0 else length
        best_running = continuing[0][0] / best_length**params.length_penalty
        worst_finished = min(s.score for s in group.finished) if len(group.finished) == params.beam_width else -1e9
        group.improvable = group.improvable and best_running > worst_finished

    def _advance(self, group: BeamGroup, continuing: list) -> None:
        """Fork parents chosen more than once, free those chosen by none, append each chosen token."""
        parents = group.live
        claimed: set[int] = set()
        new_live = []
        for score, index, token in continuing:
            parent = parents[index]
            if index in claimed:
                # Tokens are appended only after every fork, so the fork copies the parent as it was.
                beam = parent.fork(f"{group.request_id}~{next(self._ids)}", 0, parent.sampling_seed)
                self.scheduler.fork(parent, beam)
            else:
                claimed.add(index)
                beam = parent
            new_live.append((beam, token, score))
        for index, parent in enumerate(parents):
            if index not in claimed:
                self.scheduler.finish_request(parent, RequestStatus.FINISHED_STOPPED)
        for beam, token, score in new_live:
            beam.append_output_token(SampledToken(token))
            beam.cumulative_logprob = score
            beam.beam_candidates = None
        group.live = [beam for beam, _, _ in new_live]

    def _output(
        self, group: BeamGroup, sequences: list[BeamSearchSequence], finish_reason: str | None = None
    ) -> RequestOutput:
        completions = []
        for rank, sequence in enumerate(sequences):
            if self.tokenizer is not None:
                sequence.text = self.tokenizer.decode(sequence.token_ids, skip_special_tokens=True)
            completions.append(
                CompletionOutput(
                    rank,
                    sequence.text,
                    sequence.token_ids,
                    sequence.cumulative_logprob,
                    finish_reason=finish_reason or sequence.finish_reason,
                )
            )
        return RequestOutput(group.request_id, None, group.prompt_token_ids, completions, finished=True)


def _candidates(beam: Request) -> dict[int, float]:
    """A live beam's next-token candidates, which every step that samples it sets."""
    if beam.beam_candidates is None:
        raise RuntimeError(f"beam {beam.request_id} reached selection without candidates from its step")
    return beam.beam_candidates
