"""The model runner's persistent batch: one row per request it holds, kept across steps, changed only by diffs.

A row is filled when a request arrives in full (`NewRequestData`), patched by each step's diff (appended tokens,
block-table entries from the first that changed) and freed when the scheduler names the request as gone. What
sampling reads lives in per-row tensors on the device, written once per admission: temperature / top-p / min-p,
top-k and seed, the penalties, and, once any request uses penalties, a prompt-token mask and output-token counts
of [rows, vocab] that only a scatter of each step's new tokens updates (vLLM's model runner V2 keeps
`prompt_bin_mask` and `output_bin_counts` the same way). A row's logit_bias is kept as two small arrays (ids,
biases); a step with biased rows sends their (draw, id, bias) triples, which the sampler adds sparsely. So a step
gathers its rows on the device and builds nothing of size [batch, vocab] on the host. Host numpy mirrors of the
columns answer the per-step questions (any filters? all greedy? any bias?) without a device sync. The block table
is a host numpy array patched by the diffs, as vLLM v1's CPU block table; each step copies its rows' slice to the
device once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedq.engine.core.step_plan import NewRequestData, StepPlan
from pagedq.engine.sample.sampler import SamplingBatch
from pagedq.engine.sample.sampling_params import SamplingParams
from pagedq.engine.step.uploads import copy_to_device, to_device

if TYPE_CHECKING:
    from pagedq.engine.step.draws import VerifyPlan

_WANTS_LOGPROBS = attrgetter("wants_logprobs")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass
class SamplingPlan:
    rows: np.ndarray
    draw_index: np.ndarray
    positions: np.ndarray
    infos: list[RowInfo]
    first_draws: np.ndarray  # indices of each row's first draw (the one the request itself keeps)
    penalised_draws: np.ndarray  # those of rows with penalties: their counts get the drawn token
    needs_filters: bool
    all_greedy: bool
    uses_penalties: bool
    seeds: np.ndarray  # each draw's row seed, a host copy (for stand-ins of the device: the row may be reused)
    max_num_logprobs: int | None = None
    # logit_bias of the draws whose rows have one, sparse: (draw, token id, bias) triples; None when none
    logit_bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    verify: VerifyPlan | None = None  # speculative decoding's verify rows (pagedq/engine/step/draws.py)


@dataclass
class RowInfo:
    """Per-row facts read as Python objects (token lists for inputs; the rest for logprobs and min_tokens)."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    fan_out: int
    wants_logprobs: bool
    banned_ids: np.ndarray  # EOS and stop ids, masked until min_tokens outputs exist
    num_prompt_logprobs_done: int
    logit_bias: tuple[np.ndarray, np.ndarray] | None = None  # (int64 token ids, float32 biases); None without

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.num_prompt_logprobs_done < self.num_prompt_tokens


class BatchState:
    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 8) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.rows: dict[str, int] = {}
        self.info: list[RowInfo | None] = []
        self._free: list[int] = []
        self.block_table = np.zeros((0, 1), dtype=np.int32)
        self.num_blocks = np.zeros(0, dtype=np.int64)
        self.floats = np.zeros((0, len(_FLOATS)), dtype=np.float32)  # host mirror of the device columns
        self.top_k_seed = np.zeros((0, 2), dtype=np.int64)
        self.uses_penalties = np.zeros(0, dtype=bool)
        self.has_logit_bias = np.zeros(0, dtype=bool)  # host only: the bias itself is gathered per step (sparse)
        self.device_floats = torch.zeros(0, len(_FLOATS), device=device)
        self.device_top_k_seed = torch.zeros(0, 2, dtype=torch.long, device=device)
        self.last_token = torch.zeros(0, dtype=torch.long, device=device)  # each row's latest draw, on the device
        self.prompt_mask: torch.Tensor | None = None  # [rows, vocab] bool, allocated with the first penalty
        self.output_counts: torch.Tensor | None = None  # [rows, vocab] fp32
        # Writes to the device tensors above, queued by the host and run first in the next step's device work:
        # a step still running reads them, so they are ordered after it like any other device work.
        self._device_ops: list[Callable[[], None]] = []
        self._grow(capacity)
        self.run_device_ops()

    # ---- rows --------------------------------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        old = len(self.info)
        extra = capacity - old
        self.info += [None] * extra
        self._free += range(capacity - 1, old - 1, -1)
        self.block_table = np.vstack([self.block_table, np.zeros((extra, self.block_table.shape[1]), np.int32)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(extra, np.int64)])
        self.floats = np.vstack([self.floats, np.zeros((extra, len(_FLOATS)), np.float32)])
        self.top_k_seed = np.vstack([self.top_k_seed, np.zeros((extra, 2), np.int64)])
        self.uses_penalties = np.concatenate([self.uses_penalties, np.zeros(extra, bool)])
        self.has_logit_bias = np.concatenate([self.has_logit_bias, np.zeros(extra, bool)])

        def grow() -> None:
            self.device_floats = _grown(self.device_floats, capacity)
            self.device_top_k_seed = _grown(self.device_top_k_seed, capacity)
            self.last_token = _grown(self.last_token, capacity)
            if self.prompt_mask is not None and self.output_counts is not None:
                self.prompt_mask = _grown(self.prompt_mask, capacity)
                self.output_counts = _grown(self.output_counts, capacity)

        self._device_ops.append(grow)

    def take_device_ops(self) -> list[Callable[[], None]]:
        """The device writes queued since the last call (host side: the step being prepared runs them first)."""
        ops, self._device_ops = self._device_ops, []
        return ops

    def run_device_ops(self) -> None:
        """Apply the queued device writes now (for callers without a device queue: tests, start-up)."""
        for op in self.take_device_ops():
            op()

    def _set_blocks(self, row: int, first: int, block_ids: tuple[int, ...]) -> None:
        end = first + len(block_ids)
        if end > self.block_table.shape[1]:
            width = max(end, 2 * self.block_table.shape[1])
            extra = np.zeros((len(self.info), width - self.block_table.shape[1]), np.int32)
            self.block_table = np.hstack([self.block_table, extra])
        self.block_table[row, first:end] = block_ids
        self.num_blocks[row] = end

    def drop(self, req_ids) -> None:
        for req_id in req_ids:
            row = self.rows.pop(req_id, None)
            if row is not None:
                self.info[row] = None
                self.uses_penalties[row] = self.has_logit_bias[row] = False
                self._free.append(row)

    def apply(self, plan: StepPlan) -> tuple[list[int], list[RowInfo]]:
        """Drop the rows of requests that left, add the new requests, patch the held ones; returns each chunk's
        row and row info, in the plan's order."""
        self.drop(plan.finished_req_ids)
        row_of, info_of = self.rows, self.info
        rows: list[int] = []
        infos: list[RowInfo] = []
        for chunk in plan.chunks:
            if isinstance(chunk, NewRequestData):
                self._add(chunk)
                row = row_of[chunk.req_id]
                info = info_of[row]
                assert info is not None
            else:  # a held request's diff (inlined: one per request per step)
                row = row_of[chunk.req_id]
                info = info_of[row]
                if info is None:
                    raise RuntimeError(f"request {chunk.req_id} holds row {row}, which is free")
                info.token_ids.extend(chunk.new_token_ids)
                if chunk.block_ids:
                    self._set_blocks(row, chunk.block_ids_from, chunk.block_ids)
            rows.append(row)
            infos.append(info)
        return rows, infos

    def _add(self, new: NewRequestData) -> None:
        self.drop((new.req_id,))  # a stale row (its departure named in a plan that never ran)
        if not self._free:
            self._grow(2 * len(self.info))
        row = self._free.pop()
        self.rows[new.req_id] = row
        params = new.sampling_params
        banned = np.array([t for t in (*new.eos_token_ids, *params.stop_token_ids) if t < self.vocab_size], np.int64)
        self.info[row] = RowInfo(
            new.req_id,
            list(new.token_ids),
            new.num_prompt_tokens,
            params,
            new.fan_out,
            new.wants_logprobs,
            banned,
            new.num_prompt_logprobs_done,
            _bias_arrays(params.logit_bias),
        )
        self._set_blocks(row, 0, new.block_ids)
        self.block_table[row, len(new.block_ids) :] = 0  # not read (context lengths bound it), but deterministic
        self.floats[row] = [getattr(params, name) for name in _FLOATS]
        self.top_k_seed[row] = (params.top_k if params.top_k > 0 else self.vocab_size, new.sampling_seed)
        floats, top_k_seed = torch.from_numpy(self.floats[row].copy()), torch.from_numpy(self.top_k_seed[row].copy())
        self.uses_penalties[row] = params.needs_penalties
        self.has_logit_bias[row] = bool(params.logit_bias)

        def write_row() -> None:
            copy_to_device(self.device_floats[row], floats)
            copy_to_device(self.device_top_k_seed[row], top_k_seed)
            if params.needs_penalties:
                self._init_penalty_row(row, new)

        self._device_ops.append(write_row)

    def _init_penalty_row(self, row: int, new: NewRequestData) -> None:
        """The row's prompt mask and output counts from its tokens (device work; a resumed request has outputs)."""
        if self.prompt_mask is None:
            rows = len(self.info)
            self.prompt_mask = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device)
            self.output_counts = torch.zeros(rows, self.vocab_size, device=self.device)
        prompt = to_device(torch.tensor(new.token_ids[: new.num_prompt_tokens], dtype=torch.long), self.device)
        outputs = to_device(torch.tensor(new.token_ids[new.num_prompt_tokens :], dtype=torch.long), self.device)
        prompt_mask, output_counts = self._penalty_state()
        prompt_mask[row] = False
        prompt_mask[row, prompt] = True
        output_counts[row] = 0
        output_counts[row].index_add_(0, outputs, torch.ones(len(outputs), device=self.device))

    def penalty_counts(self) -> torch.Tensor:
        return self._penalty_state()[1]

    def _penalty_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt masks and output counts, which the first request with penalties allocates."""
        if self.prompt_mask is None or self.output_counts is None:
            raise RuntimeError("penalty state used before any request with penalties allocated it")
        return self.prompt_mask, self.output_counts

    # ---- one step's views ----------------------------------------------------------------------------
    def tables(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), widest] block tables of these rows (entries past a row's length are never read)."""
        width = max(int(self.num_blocks[rows].max(initial=1)), 1)
        return self.block_table[rows, :width]

    def sampling_plan(
        self,
        rows: np.ndarray,
        draw_index: np.ndarray,
        positions: np.ndarray,
        verify: VerifyPlan | None = None,
        infos: list[RowInfo] | None = None,
    ) -> SamplingPlan:
        """Host side of a step's sampling settings for draws from `rows` (a row repeats for a fan-out or for its
        verify positions; `draw_index` numbers a fan-out's draws; `positions`: the output index each draw is for;
        `infos`: the rows' infos when the caller has them)."""
        if infos is None:
            infos = [self.info[row] for row in rows.tolist()]
        floats, top_ks = self.floats[rows], self.top_k_seed[rows, 0]
        first = draw_index == 0
        if verify is not None:
            first[verify.draws] = False  # a verify row's latest token is known only after acceptance
        first_draws = np.flatnonzero(first)
        plan = SamplingPlan(
            rows,
            draw_index,
            positions,
            infos,
            first_draws,
            first_draws[self.uses_penalties[rows[first_draws]]],
            needs_filters=bool(((top_ks < self.vocab_size) | (floats[:, 1] < 1) | (floats[:, 2] > 0)).any()),
            all_greedy=bool((floats[:, 0] == 0).all()),
            uses_penalties=bool(self.uses_penalties[rows].any()),
            seeds=self.top_k_seed[rows, 1],
            verify=verify,
        )
        if any(map(_WANTS_LOGPROBS, infos)):
            plan.max_num_logprobs = max(info.params.logprobs or 0 for info in infos)
        if self.has_logit_bias[rows].any():  # no per-row Python loop for batches without a bias
            plan.logit_bias = _sparse_bias(infos)
        return plan

    def sampling_batch(self, plan: SamplingPlan) -> SamplingBatch:
        """The settings gathered on the device (device work: reads the per-row tensors)."""
        device = self.device
        index = to_device(plan.rows, device)
        temperature, top_p, min_p, repetition, presence, frequency = self.device_floats[index].T
        top_k, seeds = self.device_top_k_seed[index].T
        positions, offsets = to_device(np.stack([plan.positions, plan.draw_index]), device)
        batch = SamplingBatch(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=seeds + offsets,
            positions=positions,
            needs_filters=plan.needs_filters,
            all_greedy=plan.all_greedy,
            max_num_logprobs=plan.max_num_logprobs,
        )
        if plan.uses_penalties:
            batch.repetition_penalty, batch.presence_penalty, batch.frequency_penalty = repetition, presence, frequency
            prompt_mask, output_counts = self._penalty_state()
            batch.prompt_token_mask, batch.output_token_counts = prompt_mask[index], output_counts[index]
            if plan.verify is not None:  # a verify draw's penalties count the drafts before its position
                draft_draws, drafts = (to_device(a, device) for a in plan.verify.count_pairs())
                ones = torch.ones(len(draft_draws), device=device)
                batch.output_token_counts.index_put_((draft_draws, drafts), ones, accumulate=True)
        batch.banned_token_mask = self._banned_mask(plan.infos, plan.positions)
        if plan.logit_bias is not None:
            draws, ids, values = plan.logit_bias
            batch.logit_bias = (
                to_device(draws, device),
                to_device(ids, device),
                to_device(values, device),
            )
        return batch

    def record_draws(self, plan: SamplingPlan, token_ids: torch.Tensor) -> None:
        """Device work after sampling: each row's first draw becomes its latest token (the next step's input if
        the host does not know it yet) and, for rows with penalties, one more output-token count."""
        device = self.device
        first = to_device(plan.first_draws, device)
        self.last_token[to_device(plan.rows[plan.first_draws], device)] = token_ids[first]
        if len(plan.penalised_draws):
            draws = to_device(plan.penalised_draws, device)
            rows = to_device(plan.rows[plan.penalised_draws], device)
            self._penalty_state()[1].index_put_(
                (rows, token_ids[draws]), torch.ones(len(draws), device=device), accumulate=True
            )

    def _banned_mask(self, infos: list[RowInfo], num_outputs: np.ndarray) -> torch.Tensor | None:
        """EOS / stop ids of rows short of min_tokens, as a [B, vocab] mask built on the device."""
        banned = [
            (i, info.banned_ids)
            for i, info in enumerate(infos)
            if num_outputs[i] < info.params.min_tokens and len(info.banned_ids)
        ]
        if not banned:
            return None
        rows = np.concatenate([np.full(len(ids), i) for i, ids in banned])
        ids = np.concatenate([ids for _, ids in banned])
        mask = torch.zeros(len(infos), self.vocab_size, dtype=torch.bool, device=self.device)
        mask[to_device(rows, self.device), to_device(ids, self.device)] = True
        return mask


def _sparse_bias(infos: list[RowInfo]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The draws' logit biases as (draw, token id, bias) triples: at most 300 per draw, never [B, vocab]."""
    biased = [(i, info.logit_bias) for i, info in enumerate(infos) if info.logit_bias is not None]
    if not biased:
        return None
    draws = np.concatenate([np.full(len(ids), i, np.int64) for i, (ids, _) in biased])
    ids = np.concatenate([ids for _, (ids, _) in biased])
    values = np.concatenate([values for _, (_, values) in biased])
    return draws, ids, values


def _bias_arrays(logit_bias: dict[int, float] | None) -> tuple[np.ndarray, np.ndarray] | None:
    if not logit_bias:
        return None
    count = len(logit_bias)
    return np.fromiter(logit_bias.keys(), np.int64, count), np.fromiter(logit_bias.values(), np.float32, count)


def _grown(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    extra = torch.zeros(rows - tensor.shape[0], *tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, extra])
