"""Turns a scheduler output into tensors, runs the model over the paged cache, and samples.

The batch is flattened: decode tokens first (one per request, served by the decode kernel), then the
prefill chunks (served by the varlen prefill kernel). Only the last position of each request that
reached its final token is projected to logits and sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig, ModelConfig
from engine.models.llama import AttentionMetadata
from engine.models.loader import load_model
from engine.sampler import SamplingBatch, sample
from engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    sampled_logprobs: dict[str, float] = field(default_factory=dict)
    top_logprobs: dict[str, dict[int, float]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model_dir: str, model_config: ModelConfig, config: EngineConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.model = load_model(model_dir, model_config, config.dtype, config.device)
        self.num_blocks = config.num_kv_blocks or self._default_num_blocks()
        shape = (self.num_blocks, self.block_size, model_config.num_kv_heads, model_config.head_dim)
        # Zeroed, not empty: masked-out slots still meet 0 * value in attention, and garbage could be NaN.
        self.kv_caches = [
            (torch.zeros(shape, dtype=config.dtype, device=self.device),
             torch.zeros(shape, dtype=config.dtype, device=self.device))
            for _ in range(model_config.num_layers)
        ]

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
        ordered = sorted(scheduler_output.scheduled, key=lambda s: s.num_new_tokens > 1)  # decodes first
        input_ids, positions, meta = self._prepare_inputs(ordered)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        to_sample = [s for s in ordered if s.needs_sample]
        if not to_sample:
            return ModelRunnerOutput()
        ends = _cumulative([s.num_new_tokens for s in ordered])
        last_index = [end - 1 for end, s in zip(ends, ordered) if s.needs_sample]
        logits = self.model.compute_logits(hidden[torch.tensor(last_index, device=self.device)])
        result = sample(logits, self._sampling_batch(to_sample, logits.shape[-1]))
        return self._to_output(to_sample, result)

    def _prepare_inputs(self, ordered: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        token_ids: list[int] = []
        positions: list[int] = []
        for item in ordered:
            start, end = item.start_position, item.start_position + item.num_new_tokens
            token_ids.extend(item.request.all_token_ids[start:end])
            positions.extend(range(start, end))
        lengths = torch.tensor([s.num_new_tokens for s in ordered], dtype=torch.long)
        context_lens = torch.tensor([s.start_position + s.num_new_tokens for s in ordered], dtype=torch.int32)
        block_tables = _pad_tables([s.block_table for s in ordered])
        position_tensor = torch.tensor(positions, dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(ordered)), lengths)
        block_ids = block_tables[rows, position_tensor // self.block_size].long()
        slot_mapping = block_ids * self.block_size + position_tensor % self.block_size
        num_decode = sum(1 for s in ordered if s.num_new_tokens == 1)
        prefill_lens = [0] + [s.num_new_tokens for s in ordered[num_decode:]]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            num_decode_tokens=num_decode,
            decode_block_tables=block_tables[:num_decode].to(dev),
            decode_context_lens=context_lens[:num_decode].to(dev),
            prefill_block_tables=block_tables[num_decode:].to(dev),
            prefill_cu_seqlens_q=torch.tensor(_cumulative(prefill_lens), dtype=torch.int32, device=dev),
            prefill_context_lens=context_lens[num_decode:].to(dev),
        )
        return torch.tensor(token_ids, dtype=torch.long, device=dev), position_tensor.to(dev), meta

    def _sampling_batch(self, items: list[ScheduledRequest], vocab_size: int) -> SamplingBatch:
        requests = [s.request for s in items]
        params = [r.sampling_params for r in requests]
        dev = self.device

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=dev)

        batch = SamplingBatch(
            temperature=column([p.temperature for p in params], torch.float32),
            top_k=column([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.long),
            top_p=column([p.top_p for p in params], torch.float32),
            min_p=column([p.min_p for p in params], torch.float32),
            seeds=column([r.sampling_seed for r in requests], torch.long),
            positions=column([r.num_output_tokens for r in requests], torch.long),
            needs_filters=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
        )
        asked = [p.logprobs for p in params if p.logprobs is not None]
        batch.max_num_logprobs = max(asked) if asked else None
        if any(p.needs_penalties for p in params):
            self._add_penalties(batch, requests, vocab_size)
        banned = [(i, r) for i, r in enumerate(requests) if r.num_output_tokens < r.sampling_params.min_tokens]
        if banned:
            mask = torch.zeros(len(requests), vocab_size, dtype=torch.bool)
            for row, request in banned:
                ids = [t for t in (*request.eos_token_ids, *request.sampling_params.stop_token_ids) if t < vocab_size]
                mask[row, ids] = True
            batch.banned_token_mask = mask.to(dev)
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
    def _to_output(items: list[ScheduledRequest], result) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        token_ids = result.token_ids.tolist()  # the step's one device->host sync
        sampled_lps = result.sampled_logprobs.tolist() if result.sampled_logprobs is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        top_ids = result.top_token_ids.tolist() if result.top_token_ids is not None else None
        for row, item in enumerate(items):
            request_id = item.request.request_id
            out.sampled_token_ids[request_id] = token_ids[row]
            k = item.request.sampling_params.logprobs
            if k is None or sampled_lps is None:
                continue
            out.sampled_logprobs[request_id] = sampled_lps[row]
            top = {tid: lp for tid, lp in zip(top_ids[row][:k], top_lps[row][:k])}
            top[token_ids[row]] = sampled_lps[row]
            out.top_logprobs[request_id] = top
        return out


def _cumulative(lengths: list[int]) -> list[int]:
    total, out = 0, []
    for n in lengths:
        total += n
        out.append(total)
    return out


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
