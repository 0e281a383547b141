"""Turns a scheduler output into tensors, runs the model over the paged cache, and samples.

The batch is flattened: decode tokens first (one per request, served by the decode kernel), then the
prefill chunks (served by the varlen prefill kernel). Only the last position of each request that
reached its final token is projected to logits and sampled.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeGraphRunner
from engine.layers import AttentionMetadata
from engine.models.loader import load_model
from engine.sampler import SamplingBatch, sample
from engine.request import Request, SampledToken
from engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class StepInputs:
    """One step's flattened batch on the host, decode tokens first (numpy: built without per-token Python)."""

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: cache slot each token's K/V goes to
    block_tables: np.ndarray  # [S, M] int32, right-padded
    context_lens: np.ndarray  # [S] int32: tokens each sequence attends to, this step's included
    lengths: np.ndarray  # [S] int64: tokens each sequence brings this step
    num_decode: int  # sequences with a single token (the first num_decode rows)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode == len(self.lengths)


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)  # several draws for a fan-out
    # the prompt log-probability entries this step computed, in prompt order, per request that asked
    prompt_logprobs: list[tuple[Request, list[dict[int, float]]]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model_dir: str, model_config: ModelConfig, config: EngineConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.model = load_model(model_dir, model_config, config.dtype, config.device)
        self.kernels = self.model.kernels  # bound once, when the model was built
        self.num_blocks = config.num_kv_blocks or self._default_num_blocks()
        # Zeroed, not empty: masked-out slots still meet 0 * value in attention, and garbage could be NaN.
        self.kv_caches = self._allocate_caches(self.num_blocks, self.device, pin=False)
        self.num_host_blocks = 0
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if config.preemption_mode == "swap":
            self.num_host_blocks = max(1, int(config.swap_space_gib * 2**30) // self.bytes_per_block)
            self.host_caches = self._allocate_caches(self.num_host_blocks, torch.device("cpu"),
                                                     pin=self.device.type == "cuda")
        self.decode_graphs: DecodeGraphRunner | None = None
        self.graph_capture_seconds = 0.0
        # Only the Triton kernels are capturable: the references synchronise with the host.
        triton = self.kernels.backend == "triton"
        if self.device.type == "cuda" and triton and not config.enforce_eager:
            self.decode_graphs = DecodeGraphRunner(self.model, self.kv_caches, config.max_num_seqs,
                                                   -(-self.max_model_len // self.block_size), self.block_size,
                                                   self.device, capture=True)
            with torch.inference_mode():
                self.graph_capture_seconds = self.decode_graphs.capture_all()

    def _allocate_caches(self, num_blocks: int, device: torch.device, pin: bool):
        shape = (num_blocks, self.block_size, self.model_config.num_kv_heads, self.model_config.head_dim)

        def make() -> torch.Tensor:
            return torch.zeros(shape, dtype=self.config.dtype, device=device, pin_memory=pin)

        return [(make(), make()) for _ in range(self.model_config.num_layers)]

    @property
    def bytes_per_block(self) -> int:
        mc = self.model_config
        element = torch.tensor([], dtype=self.config.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * element

    def _default_num_blocks(self) -> int:
        if self.device.type == "cuda":
            from engine.profiling import profile_num_blocks

            return profile_num_blocks(self)
        wanted = self.config.max_num_seqs * -(-self.config.max_model_len // self.block_size)
        budget = int(self.config.cpu_kv_cache_gib * 2**30) // self.bytes_per_block
        return max(1, min(wanted, budget))

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._move_blocks(scheduler_output)
        if not scheduler_output.scheduled:
            return ModelRunnerOutput()
        ordered = sorted(scheduler_output.scheduled, key=lambda s: s.num_new_tokens > 1)  # decodes first
        hidden = self._forward(self._host_inputs(ordered))
        prompt_logprobs = self._prompt_logprobs(ordered, hidden)
        to_sample = [s for s in ordered if s.needs_sample]
        if not to_sample:
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        ends = _cumulative([s.num_new_tokens for s in ordered])
        last_index = [end - 1 for end, s in zip(ends, ordered) if s.needs_sample]
        # A request about to fork into several samples draws them all from its one row of logits.
        rows = [(s.request, i) for s in to_sample for i in range(1 + s.request.fan_out)]
        repeats = torch.tensor([1 + s.request.fan_out for s in to_sample])
        last_rows = torch.repeat_interleave(torch.tensor(last_index), repeats)
        logits = self.model.compute_logits(hidden[last_rows.to(self.device)])
        result = sample(logits, self._sampling_batch(rows, logits.shape[-1]), self.kernels)
        output = self._to_output(rows, result)
        output.prompt_logprobs = prompt_logprobs
        return output

    def _prompt_logprobs(self, ordered: list[ScheduledRequest], hidden: torch.Tensor) -> list:
        """Entries j = p + 1 of the prompt log-probabilities, from the logits at each prompt position p this step
        computed that a request still lacks: log_softmax, the prompt's own token and the top-k alternatives."""
        wanted, rows, offset = [], [], 0
        for item in ordered:
            request = item.request
            if request.needs_prompt_logprobs:
                first = max(item.start_position, len(request.prompt_logprobs) - 1)
                last = min(item.start_position + item.num_new_tokens, request.num_prompt_tokens - 1)
                if first < last:
                    wanted.append((request, first, last))
                    rows.extend(range(offset + first - item.start_position, offset + last - item.start_position))
            offset += item.num_new_tokens
        if not wanted:
            return []
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]), dim=-1)
        targets = [t for request, first, last in wanted for t in request.prompt_token_ids[first + 1:last + 1]]
        target_lps = logprobs.gather(-1, torch.tensor(targets, device=self.device)[:, None])[:, 0].tolist()
        k = max(request.sampling_params.prompt_logprobs for request, _, _ in wanted)
        if k:
            top_lps, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
        else:
            top_lps = top_ids = [[]] * len(rows)
        entries, row = [], 0
        for request, first, last in wanted:
            count, k_request = last - first, request.sampling_params.prompt_logprobs
            per_token = []
            for i in range(row, row + count):
                entry = dict(zip(top_ids[i][:k_request], top_lps[i][:k_request]))
                entry[targets[i]] = target_lps[i]
                per_token.append(entry)
            entries.append((request, per_token))
            row += count
        return entries

    def _move_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Swap-outs first (their device blocks may be rewritten this step), then swap-ins, then CoW copies."""
        if scheduler_output.blocks_to_swap_out:
            _copy_between(self.kv_caches, self.host_caches, scheduler_output.blocks_to_swap_out)
        if scheduler_output.blocks_to_swap_in:
            _copy_between(self.host_caches, self.kv_caches, scheduler_output.blocks_to_swap_in)
        if scheduler_output.blocks_to_copy:
            mapping = torch.tensor(scheduler_output.blocks_to_copy, dtype=torch.long, device=self.device)
            self.kernels.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping)

    def _host_inputs(self, ordered: list[ScheduledRequest]) -> StepInputs:
        # numpy, not Python lists or torch.tensor(nested lists): this runs every step on the host while the GPU
        # waits, and at 256 sequences with ~100-block tables the list version cost several milliseconds.
        lengths = np.fromiter((s.num_new_tokens for s in ordered), dtype=np.int64, count=len(ordered))
        starts = np.fromiter((s.start_position for s in ordered), dtype=np.int64, count=len(ordered))
        token_ids = np.fromiter(
            itertools.chain.from_iterable(s.request.all_token_ids[s.start_position:s.start_position + s.num_new_tokens]
                                          for s in ordered),
            dtype=np.int64, count=int(lengths.sum()))
        rows = np.repeat(np.arange(len(ordered)), lengths)
        chunk_offsets = np.arange(len(token_ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        positions = starts[rows] + chunk_offsets
        block_tables = _pad_tables([s.block_table for s in ordered])
        pages = block_tables[rows, positions // self.block_size].astype(np.int64)
        return StepInputs(
            token_ids=token_ids, positions=positions,
            slot_mapping=pages * self.block_size + positions % self.block_size,
            block_tables=block_tables, context_lens=(starts + lengths).astype(np.int32), lengths=lengths,
            num_decode=int(np.count_nonzero(lengths == 1)))

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states of the step's tokens: from a CUDA graph for a decode-only step, else eagerly."""
        graphs = self.decode_graphs
        if graphs is not None and inputs.is_decode_only and graphs.can_run(*inputs.block_tables.shape):
            return graphs.run(inputs.token_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables,
                              inputs.context_lens)
        num_decode, tables, context_lens = inputs.num_decode, inputs.block_tables, inputs.context_lens
        prefill_cu_seqlens = np.concatenate(([0], np.cumsum(inputs.lengths[num_decode:]))).astype(np.int32)

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device)

        meta = AttentionMetadata(
            slot_mapping=to_device(inputs.slot_mapping),
            num_decode_tokens=num_decode,
            decode_block_tables=to_device(tables[:num_decode]),
            decode_context_lens=to_device(context_lens[:num_decode]),
            prefill_block_tables=to_device(tables[num_decode:]),
            prefill_cu_seqlens_q=to_device(prefill_cu_seqlens),
            prefill_context_lens=to_device(context_lens[num_decode:]),
        )
        return self.model(to_device(inputs.token_ids), to_device(inputs.positions), self.kv_caches, meta)

    def _sampling_batch(self, rows: list[tuple[Request, int]], vocab_size: int) -> SamplingBatch:
        requests = [request for request, _ in rows]
        params = [r.sampling_params for r in requests]
        # Two host arrays, two copies to the device (not one per column); rows of [columns, B] stay contiguous.
        floats = np.array([(p.temperature, p.top_p, p.min_p) for p in params], dtype=np.float32).reshape(-1, 3)
        ints = np.array([(p.top_k if p.top_k > 0 else vocab_size, r.sampling_seed + i, r.num_output_tokens)
                         for (r, i), p in zip(rows, params)], dtype=np.int64).reshape(-1, 3)
        temperature, top_p, min_p = torch.from_numpy(np.ascontiguousarray(floats.T)).to(self.device)
        top_k, seeds, positions = torch.from_numpy(np.ascontiguousarray(ints.T)).to(self.device)
        batch = SamplingBatch(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds, positions=positions,
            needs_filters=bool(((ints[:, 0] < vocab_size) | (floats[:, 1] < 1) | (floats[:, 2] > 0)).any()),
            all_greedy=bool((floats[:, 0] == 0).all()),
        )
        if any(r.needs_logprobs for r in requests):
            batch.max_num_logprobs = max(p.logprobs or 0 for p in params)
        if any(p.needs_penalties for p in params):
            self._add_penalties(batch, requests, vocab_size)
        banned = [(i, r) for i, r in enumerate(requests) if r.num_output_tokens < r.sampling_params.min_tokens]
        if banned:
            mask = torch.zeros(len(requests), vocab_size, dtype=torch.bool)
            for row, request in banned:
                ids = [t for t in (*request.eos_token_ids, *request.sampling_params.stop_token_ids) if t < vocab_size]
                mask[row, ids] = True
            batch.banned_token_mask = mask.to(self.device)
        return batch

    def _add_penalties(self, batch: SamplingBatch, requests, vocab_size: int) -> None:
        params = [r.sampling_params for r in requests]
        prompt_mask = torch.zeros(len(requests), vocab_size, dtype=torch.bool)
        counts = torch.zeros(len(requests), vocab_size, dtype=torch.float32)
        for row, request in enumerate(requests):
            prompt_mask[row, request.prompt_token_ids] = True
            outputs = torch.tensor(request.output_token_ids, dtype=torch.long)
            counts[row].index_add_(0, outputs, torch.ones(len(outputs)))
        dev = self.device
        batch.prompt_token_mask = prompt_mask.to(dev)
        batch.output_token_counts = counts.to(dev)
        batch.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=dev)
        batch.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=dev)
        batch.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=dev)

    @staticmethod
    def _to_output(rows: list[tuple[Request, int]], result) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        token_ids = result.token_ids.tolist()  # the step's one device->host sync
        sampled_lps = result.sampled_logprobs.tolist() if result.sampled_logprobs is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        top_ids = result.top_token_ids.tolist() if result.top_token_ids is not None else None
        for row, (request, _) in enumerate(rows):
            draw = SampledToken(token_ids[row])
            if request.needs_logprobs and sampled_lps is not None:
                k = request.sampling_params.logprobs or 0
                top = dict(zip(top_ids[row][:k], top_lps[row][:k]))
                top.setdefault(token_ids[row], sampled_lps[row])
                draw = SampledToken(token_ids[row], sampled_lps[row], top)
            out.sampled.setdefault(request.request_id, []).append(draw)
        return out


def _copy_between(source: list, target: list, pairs: list[tuple[int, int]]) -> None:
    """Copy blocks (source index, target index) between two sets of per-layer caches, possibly across devices."""
    src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
    dst = torch.tensor([b for _, b in pairs], dtype=torch.long)
    for (src_k, src_v), (dst_k, dst_v) in zip(source, target):
        for src_cache, dst_cache in ((src_k, dst_k), (src_v, dst_v)):
            blocks = src_cache[src.to(src_cache.device)]
            # Only host->device may be asynchronous: a device->host copy must land before the host write reads it.
            dst_cache[dst.to(dst_cache.device)] = blocks.to(dst_cache.device, non_blocking=dst_cache.is_cuda)


def _cumulative(lengths: list[int]) -> list[int]:
    total, out = 0, []
    for n in lengths:
        total += n
        out.append(total)
    return out


def _pad_tables(tables: list[list[int]]) -> np.ndarray:
    """[len(tables), longest] int32 block tables, right-padded with block 0 (never read: context_lens bound it)."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = max(int(lengths.max(initial=0)), 1)
    values = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    padded = np.zeros((len(tables), width), dtype=np.int32)
    padded[np.arange(width)[None, :] < lengths[:, None]] = values
    return padded
