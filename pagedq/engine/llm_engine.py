"""The step-level engine: requests in, one forward pass per step, incremental outputs out.

    step():  schedule -> prepare inputs -> launch on the device -> finish the oldest step in flight
             -> tokens, fan-outs, beams, token stops -> detokenize, stop strings -> report

This is the API the Redis worker drives; `LLM` wraps it for offline batches.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import deque
from pathlib import Path

from pagedq.engine.beam_search import BeamSearchManager, BeamSearchParams
from pagedq.engine.config.engine import EngineConfig, ModelConfig
from pagedq.engine.core.block_manager import BlockManager
from pagedq.engine.core.request import Request, RequestStatus
from pagedq.engine.core.scheduler import Scheduler, SchedulerOutput
from pagedq.engine.core.seats import SeatPolicy
from pagedq.engine.core.step_plan import ModelRunnerOutput
from pagedq.engine.core.swap import SwapSpace
from pagedq.engine.errors import RequestRejected, check_context_fits
from pagedq.engine.layers.rotary import rope_cache_namespace
from pagedq.engine.output.output_processor import OutputProcessor
from pagedq.engine.output.outputs import RequestOutput
from pagedq.engine.runner.model_runner import ModelRunner, PreparedStep
from pagedq.engine.sample.sampling_params import SamplingParams
from pagedq.engine.spec_decode import Proposer
from pagedq.engine.spec_decode.drafts import DEFAULT_MAX_VERIFY_TOKENS, Speculation, default_backoff_steps
from pagedq.engine.stats import engine_stats
from pagedq.engine.step.async_step import StepHandle
from pagedq.engine.step.post_step import PostStep
from pagedq.engine.step_times import StepTimes
from pagedq.engine.structured_output.manager import StructuredOutputManager

InFlightStep = tuple[SchedulerOutput, PreparedStep, StepHandle]


class LLMEngine:
    def __init__(self, model: str | Path | None = None, **engine_kwargs) -> None:
        if model is None:
            from pagedq.engine.demo_model import demo_model_path

            model = demo_model_path()
        self.model_dir = str(model)
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        self.config = EngineConfig(model=self.model_dir, **engine_kwargs)
        if self.config.max_model_len is None:
            self.config.max_model_len = self.model_config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len, self.model_config.max_position_embeddings)
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.model_runner = ModelRunner(self.model_dir, self.model_config, self.config)
        # Only where every layer slides through one window can a request give back the blocks before it.
        window = self.model_config.sliding_window if self.model_config.every_layer_slides else 0
        self.block_manager = BlockManager(
            self.model_runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching, window or 0
        )
        swap = SwapSpace(self.model_runner.num_host_blocks) if self.config.preemption_mode == "swap" else None
        seats = SeatPolicy(self.config.seat_preemption_interval, self.config.max_seat_preemptions)
        self.scheduler = Scheduler(
            self.block_manager,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            swap,
            self.max_model_len,
            seats,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.beam_search = BeamSearchManager(self.scheduler, self.tokenizer)
        self.post_step = PostStep(
            self.scheduler, self.beam_search, self.max_model_len, self.output_processor.find_stop_strings
        )
        self._seed_source = random.Random(self.config.seed)
        self.num_steps = 0
        self.utilization_sum = 0.0
        self.num_prefilled_tokens = 0
        self.peak_used_blocks = 0
        self.step_seconds = StepTimes()
        # Steps launched and not yet finished: (scheduler's record, runner's preparation, device handle).
        self._in_flight: deque[InFlightStep] = deque()
        self._pipeline_depth = 2 if self.config.async_scheduling else 1
        self.structured: StructuredOutputManager[Request] = StructuredOutputManager(
            self.tokenizer,
            self.model_config.vocab_size,
            tuple(self.model_config.eos_token_ids),
            self.config.structured_outputs_compile_timeout_s,
            self.config.structured_outputs_cache_mib,
        )
        self.speculation: Speculation | None = None
        if self.config.speculative_config is not None:
            vocab = self.model_config.vocab_size
            spec, length = self.config.speculative_config, self.max_model_len
            backoff = default_backoff_steps(self.model_runner.device.type)
            self.speculation = Speculation.from_config(spec, vocab, length, self.structured, backoff)

    def set_proposer(
        self,
        proposer: Proposer,
        num_speculative_tokens: int,
        max_verify_tokens: int = DEFAULT_MAX_VERIFY_TOKENS,
        max_backoff_steps: int | None = None,
    ) -> None:
        """Speculative decoding with drafts from any proposer (pagedq/engine/spec_decode/), e.g. one of the tests'."""
        if self.beam_search.groups:
            raise ValueError("speculative decoding cannot start while beam searches run")
        k, vocab, length = num_speculative_tokens, self.model_config.vocab_size, self.max_model_len
        backoff = (
            default_backoff_steps(self.model_runner.device.type) if max_backoff_steps is None else max_backoff_steps
        )
        self.speculation = Speculation(proposer, k, vocab, length, max_verify_tokens, self.structured, backoff)

    # ---- admission -----------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0
    ) -> None:
        """Queue a request. priority: vLLM's sense, a lower value is served sooner and preempted later. Raises
        RequestRejected naming the problem; a refused request leaves no trace."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestRejected(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._validate_new(request_id, prompt, params.max_tokens)
        vocab = self.model_config.vocab_size
        out_of_vocab = [t for t in (params.logit_bias or ()) if t >= vocab]
        if out_of_vocab:
            raise RequestRejected(f"logit_bias token ids must be in [0, {vocab}), got {out_of_vocab[:5]}")
        # a constraint needs xgrammar and a tokenizer, and must convert to a grammar: RequestRejected now
        self.structured.check_available(params)
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        request = self._sample_waves(request_id, token_ids, text, params, int(priority), seed & (2**62 - 1))
        self.output_processor.add(request)
        if params.structured_outputs is not None:  # held until its grammar compiles, then handed to the scheduler
            self.structured.submit(request)
        else:
            self._schedule_waves(request)

    def _sample_waves(
        self, request_id: str, token_ids: list[int], text: str | None, params: SamplingParams, priority: int, seed: int
    ) -> Request:
        """The request's sequences to prefill: one whose first token forks the other samples, up to max_num_seqs in
        all; past that, more waves of them, queued behind it (`later_waves`), as vLLM queues the samples that find
        no seat. Sample i draws from seed + i whichever wave it is in, so a tight engine returns a roomy one's."""
        samples, wave = params.num_samples, self.config.max_num_seqs
        waves = [
            Request(
                request_id=request_id if first == 0 else f"{request_id}#{first}",
                prompt_token_ids=token_ids,
                sampling_params=params,
                prompt=text,
                eos_token_ids=self.model_config.eos_token_ids,
                cache_namespace=rope_cache_namespace(self.model_config, len(token_ids) + params.max_tokens),
                priority=priority,
                sampling_seed=seed + first,
                group_id=request_id,
                index=first,
                fan_out=min(wave, samples - first) - 1,
            )
            for first in range(0, samples, wave)
        ]
        waves[0].later_waves = waves[1:]
        return waves[0]

    def _schedule_waves(self, request: Request) -> None:
        for wave in (request, *request.later_waves):
            self.scheduler.add_request(wave)

    def add_beam_search_request(
        self, request_id: str, prompt: str | list[int], params: BeamSearchParams, priority: int = 0
    ) -> None:
        """Queue a beam search; its final output holds the beam_width best beams, best first (priority as
        add_request's)."""
        if not isinstance(params, BeamSearchParams):
            raise RequestRejected(f"beam search params must be a BeamSearchParams, got {type(params).__name__}")
        if self.speculation is not None:  # as vLLM
            raise RequestRejected("beam search is not supported with speculative decoding (speculative_config is set)")
        text, token_ids = self._validate_new(request_id, prompt, params.max_tokens)
        self._check_beam_group_fits(len(token_ids), params)
        root = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=SamplingParams(),
            prompt=text,
            eos_token_ids=self.model_config.eos_token_ids,
            cache_namespace=rope_cache_namespace(self.model_config, len(token_ids) + params.max_tokens),
            priority=int(priority),
        )
        self.beam_search.add(root, params, self.model_config.eos_token_ids)

    def _validate_new(self, request_id: str, prompt: str | list[int], max_tokens: int) -> tuple[str | None, list[int]]:
        if request_id in self.output_processor.groups or request_id in self.beam_search.groups:
            raise RequestRejected(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._check_fits(token_ids, max_tokens)
        return text, token_ids

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestRejected("prompt is empty")
            if self.tokenizer is None:
                raise RequestRejected(f"{self.model_dir} has no tokenizer: give the prompt as token ids")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise RequestRejected("prompt must be a string or a list of integer token ids")
        if not prompt:
            raise RequestRejected("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        return None, list(prompt)

    def _check_fits(self, token_ids: list[int], max_tokens: int) -> None:
        check_context_fits(self.max_model_len, len(token_ids), max_tokens)
        total = len(token_ids) + max_tokens
        blocks = self.block_manager.max_blocks_held(total, self.config.max_num_batched_tokens)
        if blocks > self.block_manager.num_total_blocks:
            raise RequestRejected(
                f"prompt + max_tokens needs {blocks} KV blocks but the whole cache has "
                f"{self.block_manager.num_total_blocks}"
            )

    def _check_beam_group_fits(self, prompt_len: int, params: BeamSearchParams) -> None:
        """A beam group is scheduled as a whole, so all its beams must fit at once even when none shares a
        generated block: the prompt's full blocks once (shared through the prefix cache, if on), the rest per beam."""
        config, manager, width = self.config, self.block_manager, params.beam_width
        if width > config.max_num_seqs or width > config.max_num_batched_tokens:
            raise RequestRejected(
                f"beam_width {width} exceeds max_num_seqs ({config.max_num_seqs}) or "
                f"max_num_batched_tokens ({config.max_num_batched_tokens}): its beams run together"
            )
        shared = prompt_len // manager.block_size if config.enable_prefix_caching else 0
        needed = shared + width * (manager.blocks_for_tokens(prompt_len + params.max_tokens) - shared)
        if needed > manager.num_total_blocks:
            raise RequestRejected(
                f"beam search of width {width} over {prompt_len} + {params.max_tokens} tokens needs up "
                f"to {needed} KV blocks at once but the whole cache has {manager.num_total_blocks}"
            )

    # ---- admission queries (a caller sizing what to hand over next, e.g. the queue worker) -----------
    def num_prompt_tokens(self, prompt: str | list[int]) -> int:
        """How many tokens add_request makes of this prompt; RequestRejected for one add_request would refuse."""
        return len(self._tokenize(prompt)[1])

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
        """KV blocks a request of this shape holds at its longest: every token but the last sampled one (which
        ends it before its KV is written); with n samples (best_of), the prompt's full blocks once, shared by
        the samples, the rest per sample."""
        manager = self.block_manager
        whole = manager.max_blocks_held(num_prompt_tokens + max(max_tokens, 1) - 1, self.config.max_num_batched_tokens)
        shared = num_prompt_tokens // manager.block_size if n > 1 else 0
        return shared + n * (whole - shared)

    @property
    def waiting_blocks_needed(self) -> int:
        """blocks_needed summed over the waiting queue: what it will take from num_free_blocks once admitted
        (a preempted request counts the tokens it has and the ones it may still generate)."""
        return sum(
            self.blocks_needed(r.num_tokens, r.sampling_params.max_tokens - r.num_output_tokens, 1 + r.fan_out)
            # and those compiling, all their waves of samples
            for r in (
                *self.scheduler.waiting,
                *(w for c in self.structured.waiting_requests for w in (c, *c.later_waves)),
            )
        )

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final (cumulative) output, None if unknown."""
        group = self.output_processor.groups.get(request_id)
        if group is None:
            return self.beam_search.abort(request_id)
        for request in group.live_requests():
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        self.structured.discard(request_id)
        return self.output_processor.final_output(request_id, cumulative=True)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, then finish the oldest step in flight and report what changed.

        With async scheduling two steps are in flight: the one launched here runs on the device while the previous
        one's tokens are appended, stop-checked and detokenized (one step late, as vLLM and SGLang do: a token
        drawn past a stop is dropped, never reported). Without it, the step launched is the one finished.
        """
        compiled = self._admit_compiled()  # (idle, it may first wait a little for a compile: not a step's time)
        clock = self.step_seconds
        started = time.perf_counter()
        # Speculation: drafts need every token before them, so a step that proposes waits for the one in flight
        # and runs alone (docs/engine.md); a step the verify budget leaves without drafts pipelines as usual. A masked
        # step's sampling waits for its mask in the DeviceQueue, so structured steps need no drain.
        speculate = self.speculation is not None and self.speculation.wants_drafts(self.scheduler.running)
        drain = speculate and self._in_flight
        launched = None if drain else self._schedule_and_launch(speculate)
        if launched is not None:
            self._in_flight.append(launched)
        depth = 1 if launched is not None and launched[0].num_drafts else self._pipeline_depth
        if not self._in_flight or (launched is not None and len(self._in_flight) < depth):
            return compiled  # nothing to finish yet: the pipeline is filling (or the scheduler had nothing to run)
        prepared = time.perf_counter()
        scheduler_output, step, handle = self._in_flight.popleft()
        try:
            runner_output = self.model_runner.finish(step, handle)
        except BaseException:
            self.structured.failed(recompute=True)  # a step waiting for its mask would wait forever
            self._recover_from_failed_steps(scheduler_output)
            raise
        executed = time.perf_counter()
        try:
            outputs = self._process(scheduler_output, runner_output)
        except BaseException:
            self.structured.failed(recompute=False)  # nor may the launched step wait for its mask
            raise
        clock.add(prepared - started, executed - prepared, time.perf_counter() - executed)
        return compiled + outputs

    def _schedule_and_launch(self, speculate: bool = False) -> InFlightStep | None:
        scheduler_output = self.scheduler.schedule(self.speculation) if speculate else self.scheduler.schedule()
        if speculate and self.speculation is not None:
            self.speculation.after_schedule()
        if scheduler_output.is_empty:
            self.model_runner.drop_requests(scheduler_output.plan.finished_req_ids)
            if self.scheduler.has_unfinished() and not scheduler_output.preempted and not self._in_flight:
                # Nothing changed, so the next schedule would be as empty: looping on it would spin forever.
                raise RuntimeError(
                    f"the scheduler cannot advance any of {self.num_running_requests} running and "
                    f"{self.num_waiting_requests} waiting requests (an engine bug)"
                )
            return None
        self._record_step(scheduler_output)
        step = self.model_runner.prepare(scheduler_output.plan)
        step.constrain = self.structured.launch(step, fill_now=not self._in_flight)  # its structured draws' mask
        return scheduler_output, step, self.model_runner.launch(step)

    def _process(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Tokens, fan-outs, token stops and beam selection; then stop strings; then the outputs."""
        if scheduler_output.num_drafts and self.speculation is not None:
            self.speculation.record_step(scheduler_output.scheduled, runner_output.sampled)
        self.structured.take_early(scheduler_output, runner_output.sampled)  # the next step's mask fills now
        advanced, beam_outputs = self.post_step.run(scheduler_output, runner_output)
        for request, stop in self.output_processor.find_stop_strings(advanced):
            request.stop_reason = stop
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        grammar = self.structured.advance(advanced)  # matchers take the new tokens; the next step's mask may fill
        for request, error in grammar.finishes:  # a completed grammar stops its sequence, a refused token aborts it
            if error is None:
                request.stop_reason = None
            self.scheduler.finish_request(
                request, RequestStatus.FINISHED_STOPPED if error is None else RequestStatus.FINISHED_ABORTED
            )
        outputs = self.output_processor.report(advanced)
        for output in outputs if grammar.errors else ():
            if output.finished and output.request_id in grammar.errors:
                output.error = grammar.errors[output.request_id]
        return outputs + beam_outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Structured requests whose grammar compiled go to the scheduler; those whose compile failed or timed out
        finish now, never scheduled, with the error in their final output."""
        if not self.structured.has_compiling():
            return []
        idle = not self._in_flight and not self.scheduler.has_unfinished()  # then it waits a little for a compile
        admission = self.structured.admit(idle)
        for request in admission.ready:
            self._schedule_waves(request)
        outputs = []
        for request, error in admission.failed:
            for wave in (request, *request.later_waves):
                wave.status = RequestStatus.FINISHED_ABORTED
            outputs.append(self.output_processor.final_output(request.group_id, cumulative=True))
            outputs[-1].error = error
        return outputs

    def _recover_from_failed_steps(self, failed: SchedulerOutput) -> None:
        """Leave the engine consistent after a step raised: nothing it (or a step launched after it) was to write
        can be trusted.

        Blocks were registered in the prefix cache when scheduled, and a request admitted in the same step may
        have taken them as computed: unregister them all, then send every scheduled request back to be
        recomputed from scratch (callers decide whether to retry or abort them).
        """
        outputs = [failed]
        while self._in_flight:
            later, _step, handle = self._in_flight.popleft()
            # it ran on the same broken state: whatever it raised, it is recovered below like the first
            with contextlib.suppress(BaseException):
                handle.result()
            outputs.append(later)
        for scheduler_output in outputs:
            for item in scheduler_output.scheduled:
                self.block_manager.uncache_uncomputed(item.request.request_id, item.start_position)
        for scheduler_output in outputs:
            for item in scheduler_output.scheduled:
                if item.request.status is RequestStatus.RUNNING:
                    self.scheduler.requeue_for_recompute(item.request)

    def reset_step_stats(self) -> None:
        """Zero the per-step averages (benchmarks call this after their warm-up)."""
        self.num_steps, self.utilization_sum, self.step_seconds = 0, 0.0, StepTimes()
        if self.model_runner.decode_graphs is not None:
            self.model_runner.decode_graphs.num_runs = 0

    def _record_step(self, scheduler_output) -> None:
        self.num_steps += 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.block_manager.num_used_blocks)
        self.utilization_sum += self.block_manager.kv_slot_utilization()
        self.num_prefilled_tokens += sum(
            s.num_new_tokens
            for s in scheduler_output.scheduled
            if s.num_new_tokens > 1 + len(s.draft_token_ids) or not s.needs_sample
        )

    # ---- state -------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.structured.has_compiling()

    @property
    def num_unfinished_requests(self) -> int:
        return self.num_waiting_requests + len(self.scheduler.running)

    @property
    def num_waiting_requests(self) -> int:
        # and those waiting for their grammar, each wave of samples as the scheduler will hold it
        return self.scheduler.num_waiting + sum(1 + len(r.later_waves) for r in self.structured.waiting_requests)

    @property
    def num_running_requests(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_total_blocks

    @property
    def kv_slot_utilization(self) -> float:
        return self.block_manager.kv_slot_utilization()

    def stats(self) -> dict[str, float]:
        return engine_stats(self)


def _load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None for a config-only folder (token-id prompts only)."""
    folder = Path(model_dir)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
