"""From sequences that advanced to what the caller sees: detokenization, stop strings, request outputs.

A user request is a group of sequences: one, or several samples (n / best_of) forked from one prompt.
Each sequence has its own incremental detokenizer; the group reports per its output_kind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from pagedq.engine.core.request import Request, RequestStatus
from pagedq.engine.output.detokenizer import IncrementalDetokenizer
from pagedq.engine.output.outputs import CompletionOutput, RequestOutput
from pagedq.engine.sample.sampling_params import RequestOutputKind, SamplingParams


class StopEvent(NamedTuple):
    """A running sequence whose text reached one of its stop strings."""

    request: Request
    stop: str


@dataclass
class _Sequence:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    num_reported_tokens: int = 0
    num_detokenized_tokens: int = 0
    # The token (EOS or a stop token id) that ended the sequence was kept out of its text (vLLM's rule)
    skipped_stop_token: bool = False


@dataclass
class RequestGroup:
    request_id: str
    params: SamplingParams
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: dict[int, _Sequence] = field(default_factory=dict)
    prompt_logprobs_reported: bool = False

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.params.num_samples and all(
            s.request.is_finished for s in self.sequences.values()
        )

    def live_requests(self) -> list[Request]:
        return [s.request for s in self.sequences.values() if not s.request.is_finished]


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}

    def add(self, root: Request) -> None:
        group = RequestGroup(root.group_id, root.sampling_params, root.prompt, root.prompt_token_ids)
        self.groups[root.group_id] = group
        for wave in (root, *root.later_waves):
            self._track(group, wave)

    def _track(self, group: RequestGroup, request: Request) -> _Sequence:
        detokenizer = None
        if self.tokenizer is not None:
            params = request.sampling_params
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                params.skip_special_tokens,
                params.stop,
                params.min_tokens,
                params.include_stop_str_in_output,
            )
        sequence = _Sequence(request, detokenizer)
        group.sequences[request.index] = sequence
        return sequence

    def find_stop_strings(self, advanced: list[Request]) -> list[StopEvent]:
        """Detokenize each advanced sequence's new tokens; the running ones whose text now ends in a stop string
        (the caller finishes them, then calls `report`).

        The order of checks is vLLM's (docs/engine.md): a token that stopped the sequence (EOS, a stop token
        id) is not detokenized (unless include_stop_str_in_output) and no stop string is searched after it; a
        stop string completed by the token that also reached max_tokens (or the model's length) wins over the
        length: the text is cut there and the sequence reports "stop".
        """
        events = []
        for request in advanced:
            group = self.groups[request.group_id]
            sequence = group.sequences.get(request.index) or self._track(group, request)
            if sequence.detokenizer is None:
                continue  # no tokenizer (token-id prompts only): no text, no stop strings
            stop = self._detokenize(sequence)
            if stop is None:
                continue
            if not request.is_finished:
                events.append(StopEvent(request, stop))
            elif request.status is RequestStatus.FINISHED_LENGTH:
                # already out of the scheduler (its blocks are free): only its reason changes
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        return events

    def report(self, advanced: list[Request]) -> list[RequestOutput]:
        """One output per group that advanced, per its output kind (the final one for a finished group)."""
        touched: dict[str, tuple[list[int], bool] | None] = {}
        final_only, running = RequestOutputKind.FINAL_ONLY, RequestStatus.RUNNING
        for request in advanced:
            status = request.status
            finished = status is not running and status.is_finished
            if not finished and request.sampling_params.output_kind is final_only:
                # Nothing to report for it (its group may still finish by another sequence, which fills the entry).
                touched.setdefault(request.group_id, None)
                continue
            indices, any_finished = touched.get(request.group_id) or ([], False)
            indices.append(request.index)
            touched[request.group_id] = indices, any_finished or finished
        outputs = []
        for group_id, entry in touched.items():
            if entry is None:
                continue
            # A group can only have finished this step if one of the sequences that advanced did.
            output = self._report(self.groups[group_id], *entry)
            if output is not None:
                outputs.append(output)
        return outputs

    @staticmethod
    def _detokenize(sequence: _Sequence) -> str | None:
        """Feed the tokens the detokenizer has not seen (a fresh fork brings its parent's); the stop string hit."""
        if sequence.detokenizer is None:
            return None
        request, stop = sequence.request, None
        new_tokens = request.all_token_ids[request.num_prompt_tokens + sequence.num_detokenized_tokens :]
        # Stopped by a token (EOS or a stop id) it holds last, not by a stop string nor a completed grammar
        token_stopped = request.status is RequestStatus.FINISHED_STOPPED and (
            isinstance(request.stop_reason, int) or request.all_token_ids[-1] in request.eos_token_ids
        )
        if token_stopped and new_tokens and not request.sampling_params.include_stop_str_in_output:
            new_tokens, sequence.skipped_stop_token = new_tokens[:-1], True
        for token in new_tokens:
            stop = sequence.detokenizer.append(token)
            if stop is not None:
                break
        sequence.num_detokenized_tokens = request.num_output_tokens
        return None if token_stopped else stop

    def _report(self, group: RequestGroup, indices: list[int], maybe_finished: bool) -> RequestOutput | None:
        if maybe_finished and group.finished:
            return self.final_output(group.request_id)
        kind = group.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY:
            return None
        delta = kind is RequestOutputKind.DELTA
        chosen = sorted(set(indices)) if delta else sorted(group.sequences)
        return self._output(group, [group.sequences[i] for i in chosen], delta, finished=False)

    def final_output(self, group_id: str, cumulative: bool = False) -> RequestOutput:
        """The group's closing report (all sequences must be finished); forgets the group.

        Per the output kind, or everything generated when `cumulative` (what an abort hands back).
        """
        group = self.groups.pop(group_id)
        sequences = list(group.sequences.values())
        for sequence in sequences:
            if sequence.detokenizer is not None:
                stopped_by_string = isinstance(sequence.request.stop_reason, str)
                token_ids = sequence.request.output_token_ids
                if sequence.skipped_stop_token:
                    token_ids = token_ids[:-1]
                sequence.detokenizer.finalize(token_ids, stopped_by_string)
        if group.params.num_samples > group.params.n:  # keep the n most likely samples, best first
            sequences.sort(key=lambda s: s.request.cumulative_logprob, reverse=True)
        else:
            sequences.sort(key=lambda s: s.request.index)
        delta = group.params.output_kind is RequestOutputKind.DELTA and not cumulative
        output = self._output(group, sequences[: group.params.n], delta, finished=True)
        output.metrics["finished_time"] = time.monotonic()
        return output

    def _output(self, group: RequestGroup, sequences: list[_Sequence], delta: bool, finished: bool) -> RequestOutput:
        completions = [
            self._completion(position if finished else s.request.index, s, delta)
            for position, s in enumerate(sequences)
        ]
        first = (
            min((s.request.first_token_time for s in sequences if s.request.first_token_time), default=None)
            if len(sequences) > 1
            else sequences[0].request.first_token_time
        )
        metrics = {"arrival_time": sequences[0].request.arrival_time}
        if first is not None:
            metrics["first_token_time"] = first
        prompt_logprobs = None
        if group.params.prompt_logprobs is not None and not (delta and group.prompt_logprobs_reported):
            prompt_logprobs = sequences[0].request.prompt_logprobs
            group.prompt_logprobs_reported = True
        # Forks copy the root's count; a group not admitted yet (or aborted while waiting) has none.
        num_cached = max(0, max(s.request.num_cached_tokens for s in group.sequences.values()))
        preemptions = sum(s.request.num_preemptions for s in group.sequences.values())
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            completions,
            finished,
            metrics,
            prompt_logprobs,
            num_cached,
            num_preemptions=preemptions,
        )

    @staticmethod
    def _completion(index: int, sequence: _Sequence, delta: bool) -> CompletionOutput:
        request = sequence.request
        finished = request.is_finished
        detok = sequence.detokenizer
        new_text = detok.take_delta(finished) if detok is not None else ""
        start = sequence.num_reported_tokens if delta else 0
        sequence.num_reported_tokens = request.num_output_tokens
        wants_logprobs = request.sampling_params.logprobs is not None
        return CompletionOutput(
            index=index,
            text=new_text if delta else (detok.reported_text() if detok is not None else ""),
            token_ids=request.all_token_ids[request.num_prompt_tokens + start :],
            cumulative_logprob=request.cumulative_logprob if request.needs_logprobs else None,
            logprobs=request.logprobs[start:] if wants_logprobs else None,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason if finished else None,
        )
