"""The step-level engine: requests in, one forward pass per step, incremental outputs out.

    step():  schedule -> run the model -> update requests -> detokenize, stop, report

This is the API the Redis worker drives; `LLM` wraps it for offline batches.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler import Scheduler


@dataclass
class _Tracked:
    """Engine-side state of a request beyond what the scheduler needs."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    num_reported_tokens: int = 0


class LLMEngine:
    def __init__(self, model: str | Path | None = None, **engine_kwargs) -> None:
        if model is None:
            from engine.demo_model import demo_model_path

            model = demo_model_path()
        self.model_dir = str(model)
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        self.config = EngineConfig(model=self.model_dir, **engine_kwargs)
        if self.config.max_model_len is None:
            self.config.max_model_len = self.model_config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len, self.model_config.max_position_embeddings)
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.model_runner = ModelRunner(self.model_dir, self.model_config, self.config)
        self.block_manager = BlockManager(self.model_runner.num_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self._requests: dict[str, _Tracked] = {}
        self._seed_source = random.Random(self.config.seed)
        self.num_steps = 0
        self._utilization_sum = 0.0
        self.num_prefilled_tokens = 0

    # ---- admission -----------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0
    ) -> None:
        """Queue a request. Raises ValueError naming the problem; a refused request leaves no trace."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._check_fits(token_ids, params)
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        request = Request(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params, prompt=text,
            eos_token_ids=self.model_config.eos_token_ids, priority=int(priority),
            sampling_seed=seed & (2**63 - 1),
        )
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop)
        self._requests[request_id] = _Tracked(request, detokenizer)
        self.scheduler.add_request(request)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer: give the prompt as token ids")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in prompt):
            raise ValueError("prompt must be a string or a list of integer token ids")
        if not prompt:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        return None, list(prompt)

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the model's max length {self.max_model_len}")
        blocks = self.block_manager.blocks_for_tokens(total)
        if blocks > self.block_manager.num_total_blocks:
            raise ValueError(f"prompt + max_tokens needs {blocks} KV blocks but the whole cache has "
                             f"{self.block_manager.num_total_blocks}")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final (cumulative) output, None if unknown."""
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish_request(tracked.request, RequestStatus.FINISHED_ABORTED)
        return self._final_output(tracked)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        runner_output = self.model_runner.execute(scheduler_output)
        self.num_steps += 1
        self._utilization_sum += self.block_manager.kv_slot_utilization()
        self.num_prefilled_tokens += sum(s.num_new_tokens for s in scheduler_output.scheduled
                                         if s.num_new_tokens > 1 or not s.needs_sample)
        advanced = self.scheduler.update_from_output(
            scheduler_output, runner_output.sampled_token_ids, self.max_model_len)
        outputs = []
        for request in advanced:
            if request.sampling_params.logprobs is not None:
                request.cumulative_logprob += runner_output.sampled_logprobs[request.request_id]
                request.logprobs.append(runner_output.top_logprobs[request.request_id])
            output = self._process(self._requests[request.request_id])
            if output is not None:
                outputs.append(output)
        return outputs

    def _process(self, tracked: _Tracked) -> RequestOutput | None:
        request = tracked.request
        if tracked.detokenizer is not None:
            stop = tracked.detokenizer.append(request.all_token_ids[-1])
            if stop is not None and not request.is_finished:
                request.stop_reason = stop
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        if request.is_finished:
            del self._requests[request.request_id]
            return self._final_output(tracked)
        kind = request.sampling_params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY:
            return None
        return self._make_output(tracked, delta=kind is RequestOutputKind.DELTA)

    def _final_output(self, tracked: _Tracked) -> RequestOutput:
        request = tracked.request
        if tracked.detokenizer is not None:
            tracked.detokenizer.finalize(request.output_token_ids, isinstance(request.stop_reason, str))
        delta = request.sampling_params.output_kind is RequestOutputKind.DELTA
        output = self._make_output(tracked, delta=delta)
        output.metrics["finished_time"] = time.monotonic()
        return output

    def _make_output(self, tracked: _Tracked, delta: bool) -> RequestOutput:
        request = tracked.request
        finished = request.is_finished
        detok = tracked.detokenizer
        new_text = detok.take_delta(finished) if detok is not None else ""
        start = tracked.num_reported_tokens if delta else 0
        tracked.num_reported_tokens = request.num_output_tokens
        completion = CompletionOutput(
            index=0,
            text=new_text if delta else (detok.reported_text() if detok is not None else ""),
            token_ids=request.all_token_ids[request.num_prompt_tokens + start:],
            cumulative_logprob=request.cumulative_logprob if request.sampling_params.logprobs is not None else None,
            logprobs=request.logprobs[start:] if request.sampling_params.logprobs is not None else None,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason if finished else None,
        )
        metrics = {"arrival_time": request.arrival_time}
        if request.first_token_time is not None:
            metrics["first_token_time"] = request.first_token_time
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion],
                             finished, metrics)

    # ---- state -------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_waiting + len(self.scheduler.running)

    @property
    def num_waiting_requests(self) -> int:
        return self.scheduler.num_waiting

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
        return {
            "num_total_blocks": self.num_total_blocks,
            "num_free_blocks": self.num_free_blocks,
            "kv_slot_utilization": self.kv_slot_utilization,
            "mean_kv_slot_utilization": self._utilization_sum / self.num_steps if self.num_steps else 1.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_prefilled_tokens": self.num_prefilled_tokens,
            "num_running_requests": self.num_running_requests,
            "num_waiting_requests": self.num_waiting_requests,
        }


def _load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None for a config-only folder (token-id prompts only)."""
    folder = Path(model_dir)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
