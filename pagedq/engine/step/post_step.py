"""After the forward pass, in one explicit stage: draws become tokens, fan-outs fork, beams select, token stops.

    advance_sequences(): computed counts catch up; each draw is appended to its sequence (a request whose first
                         token brings several draws, n / best_of, forks its siblings here); beams keep their
                         candidates; EOS, stop ids and length limits finish sequences
    PostStep.run():      the above, then beam selection for every group whose live beams all hold candidates

Stop strings need text, so they are found later by the output processor, which returns them as stop events.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedq.engine.core.request import Request, RequestStatus, SampledToken
from pagedq.engine.core.scheduler import Scheduler, SchedulerOutput
from pagedq.engine.core.step_plan import ModelRunnerOutput
from pagedq.engine.output.outputs import RequestOutput

# The output processor's stop-string search over some sequences: (sequence, stop string) for the running ones
FindStops = Callable[[list[Request]], Sequence[tuple[Request, str]]]


def advance_sequences(
    scheduler: Scheduler,
    output: SchedulerOutput,
    sampled: dict[str, list[SampledToken]],
    max_model_len: int,
    prompt_logprobs: dict[str, list[dict[int, float]]] | None = None,
    find_stops: FindStops | None = None,
) -> list[Request]:
    """Apply one step's results to the scheduler's requests (whose computed counts advanced when scheduled);
    returns every sequence that got a new token (finished and newly forked ones included)."""
    advanced, verified = [], []
    running = RequestStatus.RUNNING
    for item in output.scheduled:
        request = item.request
        status = request.status
        if (status is not running and status.is_finished) or request.epoch != item.epoch:
            continue  # finished, aborted or sent back to recompute while the step ran (async): drop its result
        request.land_chunk(item)
        is_beam = request.is_beam
        if prompt_logprobs and request.request_id in prompt_logprobs:
            request.prompt_logprobs.extend(prompt_logprobs[request.request_id])
        draws = sampled.get(request.request_id)
        if not draws:
            continue  # a prefill chunk that did not reach the end of the prompt
        if is_beam:
            request.beam_candidates = draws[0].top_logprobs
            continue
        if item.draft_token_ids:
            _advance_verified(scheduler, request, draws, max_model_len, find_stops)
            verified.append(request)
            continue
        if len(draws) == 1:  # the common case, without the zip (nor a call, for a bare token after the first)
            draw = draws[0]
            if draw[1] is None and draw[2] is None and request.first_token_time is not None:
                request.all_token_ids.append(draw[0])  # all append_output_token does for it
            else:
                request.append_output_token(draw)
            advanced.append(request)
            continue
        for sequence, draw in zip(_fan_out(scheduler, request, len(draws)), draws):
            sequence.append_output_token(draw)
            advanced.append(sequence)
    for sequence in advanced:
        stop = sequence.check_token_stop(max_model_len)
        if stop is not None:
            scheduler.finish_request(sequence, stop)
    return advanced + verified


def _advance_verified(
    scheduler: Scheduler, request: Request, draws: list[SampledToken], max_model_len: int, find_stops: FindStops | None
) -> None:
    """A verify row's tokens (its accepted drafts and the draw after them), one at a time, each checked for every
    stop as if it had come alone: EOS, stop ids and lengths, then stop strings. Tokens past a stop are dropped,
    never reported. A row that goes on is cut back to what verification kept: its computed count (the rejected
    drafts' slots hold nothing) and the lookahead blocks past it."""
    for draw in draws:
        request.append_output_token(draw)
        stop = request.check_token_stop(max_model_len)
        if stop is not None:
            scheduler.finish_request(request, stop)
        for sequence, stop_string in find_stops([request]) if find_stops is not None else ():
            sequence.stop_reason = stop_string
            scheduler.finish_request(sequence, RequestStatus.FINISHED_STOPPED)
        if request.is_finished:
            return
    request.keep_verified()
    manager = scheduler.block_manager
    manager.trim(request.request_id, request.num_computed_tokens)
    request.runner_blocks_changed_from(len(manager.block_table(request.request_id)))


def _fan_out(scheduler: Scheduler, request: Request, num_draws: int) -> list[Request]:
    """The request plus the siblings forked from it when its first token brings several draws: samples
    request.index + 1 on, each drawing from its own seed (LLMEngine._sample_waves)."""
    sequences = [request]
    for offset in range(1, num_draws):
        index = request.index + offset
        child = request.fork(f"{request.group_id}#{index}", index, request.sampling_seed + offset)
        scheduler.fork(request, child)
        sequences.append(child)
    request.fan_out = 0
    return sequences


class PostStep:
    def __init__(
        self, scheduler: Scheduler, beam_search, max_model_len: int, find_stops: FindStops | None = None
    ) -> None:
        self.scheduler = scheduler
        self.beam_search = beam_search  # engine.beam_search.BeamSearchManager
        self.max_model_len = max_model_len
        self.find_stops = find_stops

    def run(self, output: SchedulerOutput, result: ModelRunnerOutput) -> tuple[list[Request], list[RequestOutput]]:
        """(sequences that advanced, outputs of beam groups that finished)."""
        advanced = advance_sequences(
            self.scheduler, output, result.sampled, self.max_model_len, result.prompt_logprobs, self.find_stops
        )
        return advanced, self.beam_search.step()
