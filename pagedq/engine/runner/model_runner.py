"""Turns a scheduler output into tensors, runs the model over the paged cache, and samples.

The batch is flattened: decode tokens first (one per request, served by the decode kernel), then the
prefill chunks and speculative verify rows (served by the varlen prefill kernel). Only the last position of each
request that reached its final token is projected to logits and sampled (every position of a verify row).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedq.engine.config.engine import EngineConfig, ModelConfig, resolve_dtype
from pagedq.engine.core.step_plan import ModelRunnerOutput, ScheduledChunk, StepPlan
from pagedq.engine.layers import AttentionMetadata
from pagedq.engine.layers.rotary import rope_table_rows
from pagedq.engine.models.loader import load_model
from pagedq.engine.runner.cuda_graphs import DecodeGraphRunner
from pagedq.engine.sample.sampler import sample
from pagedq.engine.spec_decode.verify import record_verified
from pagedq.engine.step.async_step import DeviceQueue, DeviceResult, StepHandle
from pagedq.engine.step.batch_state import BatchState, RowInfo, SamplingPlan
from pagedq.engine.step.draws import draw_layout
from pagedq.engine.step.runner_outputs import prompt_logprobs, sampled_tokens
from pagedq.engine.step.step_inputs import StepInputs, build_step_inputs, decodes_first
from pagedq.engine.step.uploads import to_device


@dataclass
class PreparedStep:
    """A step's host-side preparation: what its device work reads (nothing the host changes afterwards)."""

    plan: StepPlan
    device_ops: list[Callable[[], None]]  # the persistent batch's device writes, run before the forward
    ordered: list[ScheduledChunk] = field(default_factory=list)  # decodes first
    infos: list[RowInfo] = field(default_factory=list)  # their rows
    inputs: StepInputs | None = None
    sampling: SamplingPlan | None = None
    last_index: np.ndarray | None = None  # flat token index whose logits each draw samples
    # structured outputs: masks the draws' logits in place before sampling (structured_output/step_mask.py)
    constrain: Callable[[torch.Tensor], None] | None = None


class ModelRunner:
    def __init__(self, model_dir: str, model_config: ModelConfig, config: EngineConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings
        )
        self.dtype = resolve_dtype(config.dtype, config.device)  # as EngineConfig resolved it (typed for mypy)
        self.model = load_model(model_dir, model_config, self.dtype, config.device)
        self.kernels = self.model.kernels  # bound once, when the model was built
        self.state = BatchState(model_config.vocab_size, self.device, capacity=config.max_num_seqs)
        self.device_queue = DeviceQueue(self.device)
        self.num_device_fed_tokens = 0  # input tokens taken from the previous step's draws on the device (async)
        self.num_blocks = config.num_kv_blocks or self._default_num_blocks()
        # Zeroed, not empty: masked-out slots still meet 0 * value in attention, and garbage could be NaN.
        self.kv_caches = self._allocate_caches(self.num_blocks, self.device, pin=False)
        self.num_host_blocks = 0
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if config.preemption_mode == "swap":
            self.num_host_blocks = max(1, int(config.swap_space_gib * 2**30) // self.bytes_per_block)
            self.host_caches = self._allocate_caches(
                self.num_host_blocks, torch.device("cpu"), pin=self.device.type == "cuda"
            )
        self.decode_graphs: DecodeGraphRunner | None = None
        self.graph_capture_seconds = 0.0
        # Only the Triton kernels are capturable: the references synchronise with the host.
        triton = self.kernels.backend == "triton"
        if self.device.type == "cuda" and triton and not config.enforce_eager:
            self.decode_graphs = DecodeGraphRunner(
                self.model,
                self.kv_caches,
                config.max_num_seqs,
                -(-self.max_model_len // self.block_size),
                self.block_size,
                self.device,
                capture=True,
            )
            with torch.inference_mode():
                self.graph_capture_seconds = self.decode_graphs.capture_all()

    def _allocate_caches(self, num_blocks: int, device: torch.device, pin: bool):
        shape = (num_blocks, self.block_size, self.model_config.num_kv_heads, self.model_config.head_dim)

        def make() -> torch.Tensor:
            if device.type == "cpu" and not pin:
                return _lazily_zeroed(shape, self.dtype)
            return torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin)

        return [(make(), make()) for _ in range(self.model_config.num_layers)]

    @property
    def bytes_per_block(self) -> int:
        mc = self.model_config
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * element

    def _default_num_blocks(self) -> int:
        if self.device.type == "cuda":
            from pagedq.engine.runner.profiling import profile_num_blocks

            return profile_num_blocks(self)
        wanted = self.config.max_num_seqs * -(-(self.config.max_model_len or self.max_model_len) // self.block_size)
        budget = int(self.config.cpu_kv_cache_gib * 2**30) // self.bytes_per_block
        return max(1, min(wanted, budget))

    # ---- one step ------------------------------------------------------------------------------
    def drop_requests(self, req_ids) -> None:
        """Forget requests that left while no step ran."""
        self.state.drop(req_ids)

    def execute(self, plan: StepPlan) -> ModelRunnerOutput:
        """One step, synchronously."""
        step = self.prepare(plan)
        return self.finish(step, self.launch(step))

    def prepare(self, plan: StepPlan) -> PreparedStep:
        """Host side: patch the persistent batch and build the step's inputs (may run while a step is on the
        device: nothing here reads or writes device tensors)."""
        rows_of_chunks, infos_of_chunks = self.state.apply(plan)
        # Taken here, on the host, and run by this step's device work: the device thread never touches the queue.
        device_ops = self.state.take_device_ops()
        if not plan.chunks:
            return PreparedStep(plan, device_ops)
        ordered, rows, infos, lengths = decodes_first(plan.chunks, rows_of_chunks, infos_of_chunks)
        inputs = build_step_inputs(ordered, infos, rows, self.state.tables(rows), self.block_size, lengths)
        if self.model_config.rope_short_until is not None:  # LongRoPE: each sequence's rows by its longest length
            longest = (info.num_prompt_tokens + info.params.max_tokens for info in infos)
            max_lengths = np.repeat(np.fromiter(longest, dtype=np.int64, count=len(infos)), inputs.lengths)
            inputs.rope_rows = rope_table_rows(self.model_config, inputs.positions, max_lengths)
        self.num_device_fed_tokens += len(inputs.placeholders)
        draws = draw_layout(ordered, infos, rows, inputs.lengths)
        if draws is None:
            return PreparedStep(plan, device_ops, ordered, infos, inputs)
        for i in draws.forking.tolist():
            infos[i].fan_out = 0  # spent: a row forks once, at the draws laid out now
        # every chunk draws once, in order (most steps), or each draw takes its chunk's row info
        once_each = np.array_equal(draws.draw_chunk, np.arange(len(infos)))
        draw_infos = infos if once_each else [infos[i] for i in draws.draw_chunk.tolist()]
        sampling = self.state.sampling_plan(draws.rows, draws.draw_index, draws.positions, draws.verify, draw_infos)
        return PreparedStep(plan, device_ops, ordered, infos, inputs, sampling, draws.last_index)

    def launch(self, step: PreparedStep) -> StepHandle:
        """Queue the step's device work: it runs after every step launched before it (a step whose sampling waits
        for its structured-output mask: on CUDA, its forward is queued now and its sampling once the mask is in)."""
        return self.device_queue.submit(lambda: self._device_work(step), waits=step.constrain is not None)

    def finish(self, step: PreparedStep, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a launched step; its results keyed by request id."""
        result = handle.result()
        output = ModelRunnerOutput(prompt_logprobs=result.extra or {})
        if result.sampled is not None and step.sampling is not None:  # sampled only with a sampling plan
            sampled_tokens(step.sampling.infos, result.sampled, output, step.sampling.verify is not None)
        return output

    def _device_work(self, step: PreparedStep) -> DeviceResult:
        """Forward + sampler, and the persistent batch's queued device writes before them (device work only)."""
        for op in step.device_ops:
            op()
        self._move_blocks(step.plan)
        if step.inputs is None:
            return DeviceResult(None)
        hidden = self._forward(step.inputs)
        extra = prompt_logprobs(step.ordered, step.infos, hidden, self.model)
        if step.sampling is None:
            return DeviceResult(None, extra)
        assert step.last_index is not None  # every sampling plan has its draws' token indices
        logits = self.model.compute_logits(hidden[to_device(step.last_index, self.device)])
        result = sample(logits, self.state.sampling_batch(step.sampling), self.kernels, step.constrain)
        self.state.record_draws(step.sampling, result.token_ids)
        if step.sampling.verify is not None:  # speculative decoding: accept, and drop the draws past a rejection
            result.token_ids = record_verified(self.state, step.sampling.verify, result.token_ids)
        return DeviceResult(result, extra)

    def _move_blocks(self, plan: StepPlan) -> None:
        """Swap-outs first (their device blocks may be rewritten this step), then swap-ins, then CoW copies."""
        if plan.blocks_to_swap_out:
            _copy_between(self.kv_caches, self.host_caches, plan.blocks_to_swap_out)
        if plan.blocks_to_swap_in:
            _copy_between(self.host_caches, self.kv_caches, plan.blocks_to_swap_in)
        if plan.blocks_to_copy:
            mapping = to_device(torch.tensor(plan.blocks_to_copy, dtype=torch.long), self.device)
            self.kernels.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states of the step's tokens: from a CUDA graph for a decode-only step, else eagerly."""
        token_ids = to_device(inputs.token_ids, self.device)
        if len(inputs.placeholders):  # tokens the host has not seen yet: the previous step's draws, on the device
            rows = to_device(inputs.placeholder_rows, self.device)
            token_ids[to_device(inputs.placeholders, self.device)] = self.state.last_token[rows]
        graphs = self.decode_graphs
        rope_rows = inputs.positions if inputs.rope_rows is None else inputs.rope_rows  # the model reads them only
        if graphs is not None and inputs.is_decode_only and graphs.can_run(*inputs.block_tables.shape):
            return graphs.run(token_ids, rope_rows, inputs.slot_mapping, inputs.block_tables, inputs.context_lens)
        num_decode, tables, context_lens = inputs.num_decode, inputs.block_tables, inputs.context_lens
        prefill_cu_seqlens = np.concatenate(([0], np.cumsum(inputs.lengths[num_decode:]))).astype(np.int32)

        device = self.device
        meta = AttentionMetadata(
            slot_mapping=to_device(inputs.slot_mapping, device),
            num_decode_tokens=num_decode,
            decode_block_tables=to_device(tables[:num_decode], device),
            decode_context_lens=to_device(context_lens[:num_decode], device),
            prefill_block_tables=to_device(tables[num_decode:], device),
            prefill_cu_seqlens_q=to_device(prefill_cu_seqlens, device),
            prefill_context_lens=to_device(context_lens[num_decode:], device),
        )
        return self.model(token_ids, to_device(rope_rows, device), self.kv_caches, meta)


def _lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in its own anonymous mapping: the OS supplies zero pages on first touch, so the process
    holds only the blocks it writes, not the whole pool (torch.zeros writes every page up front: a 1 GiB default
    CPU pool was 1 GiB of resident memory before the first request)."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(num_bytes, 1))  # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=torch.uint8)[:num_bytes].view(dtype).view(shape)


def _copy_between(source: list, target: list, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy blocks (source index, target index) between two sets of per-layer caches, possibly across devices."""
    src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
    dst = torch.tensor([b for _, b in pairs], dtype=torch.long)
    for (src_k, src_v), (dst_k, dst_v) in zip(source, target):
        for src_cache, dst_cache in ((src_k, dst_k), (src_v, dst_v)):
            blocks = src_cache[src.to(src_cache.device)]
            # Only host->device may be asynchronous: a device->host copy must land before the host write reads it.
            dst_cache[dst.to(dst_cache.device)] = blocks.to(dst_cache.device, non_blocking=dst_cache.is_cuda)
