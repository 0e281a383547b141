"""Batched sampling: logit bias, penalties, temperature, top-k, top-p, min-p, seeded Gumbel-max, logprobs.

Everything is one tensor op over the batch; no Python loop per request. Randomness comes from a
counter-based hash of (request seed, output position, token id), so a request's samples do not depend
on which other requests share its batch, on preemption, or on the device: the same seed gives the
same output, always. Sampling with Gumbel-max (argmax of logits/T + Gumbel noise) draws exactly from
softmax(logits/T) restricted to the tokens the filters keep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedq import kernels


@dataclass
class SamplingBatch:
    """Per-row sampling settings, already on the logits' device."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, vocab_size when disabled
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: index of the output token being drawn
    repetition_penalty: torch.Tensor | None = None  # [B] fp32, None when no row uses penalties
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    prompt_token_mask: torch.Tensor | None = None  # [B, V] bool: token occurs in the prompt
    output_token_counts: torch.Tensor | None = None  # [B, V] fp32: occurrences in the output so far
    banned_token_mask: torch.Tensor | None = None  # [B, V] bool: EOS/stop ids before min_tokens
    # logit_bias, sparse: (row, token id, bias) triples added to the logits first; None when no row has one
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    max_num_logprobs: int | None = None  # largest `logprobs` asked for in the batch, None if none
    needs_filters: bool = True  # False when no row uses top-k, top-p or min-p: skips the sort

    all_greedy: bool | None = None  # known from the host-side params: saves a device sync per step

    def __post_init__(self) -> None:
        if self.all_greedy is None:
            self.all_greedy = bool((self.temperature == 0).all())


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    sampled_logprobs: torch.Tensor | None  # [B] fp32 log-prob of each sampled token
    top_logprobs: torch.Tensor | None  # [B, K] fp32
    top_token_ids: torch.Tensor | None  # [B, K] int64


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    ops: kernels.KernelSet | None = None,
    constrain: Callable[[torch.Tensor], None] | None = None,
) -> SamplerOutput:
    """logits [B, V] fp32 (raw model output) -> one token per row. `ops`: the model's bound kernels (else bound now).
    `constrain` masks disallowed tokens in place (structured outputs) after the logprobs are taken, so those stay
    the model's, and before everything else, so every sampling mode draws among the allowed tokens only."""
    raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_num_logprobs is not None else None
    if constrain is not None:
        constrain(logits)
    if batch.logit_bias is not None:  # before penalties and filters, as vLLM's logits processors
        rows, ids, values = batch.logit_bias
        logits = logits.index_put((rows, ids), values, accumulate=True)
    logits = apply_penalties(logits, batch)
    if batch.banned_token_mask is not None:
        logits = logits.masked_fill(batch.banned_token_mask, float("-inf"))
    if batch.all_greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        if batch.needs_filters:  # filters act on the temperature-scaled distribution; then sample at T = 1
            logits = apply_filters(logits / batch.temperature.clamp_min(1e-6)[:, None], batch)
            temperature = torch.where(batch.temperature == 0, 0.0, 1.0)
        else:
            temperature = batch.temperature
        ops = ops or kernels.bind(logits.device)
        token_ids = ops.gumbel_argmax(logits, temperature, batch.seeds, batch.positions)
    if raw_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    sampled_logprobs = raw_logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    top_logprobs, top_ids = (
        raw_logprobs.topk(batch.max_num_logprobs, dim=-1)
        if batch.max_num_logprobs
        else (raw_logprobs[:, :0], token_ids[:, None][:, :0])
    )
    return SamplerOutput(token_ids, sampled_logprobs, top_logprobs, top_ids)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty over prompt+output tokens (as transformers), presence/frequency over outputs (as OpenAI)."""
    # built together, or none of them when no row uses penalties
    repetition, presence, frequency = batch.repetition_penalty, batch.presence_penalty, batch.frequency_penalty
    counts, prompt_mask = batch.output_token_counts, batch.prompt_token_mask
    if repetition is None or presence is None or frequency is None or counts is None or prompt_mask is None:
        return logits
    occurs = counts > 0
    seen = prompt_mask | occurs
    penalty = repetition[:, None]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * occurs.float()


def apply_filters(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """top-k, then top-p over what remains, then min-p (transformers' order). Removed tokens get -inf.

    Sorted ascending, top-p removes the tokens whose mass together with every worse token's is at most 1 - top_p
    (transformers' TopPLogitsWarper, vLLM): a descending running sum saturates at 1.0 in fp32 and would cut the
    tail even at top_p = 1.0, making a plain row's draw depend on whether a neighbour filters.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # ascending: the best token is last
    ranks_from_best = torch.arange(vocab_size - 1, -1, -1, device=logits.device)[None, :]
    remove = ranks_from_best >= batch.top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_up_to = probs.cumsum(dim=-1)  # this token's probability plus every worse token's
    top_p = batch.top_p[:, None]
    remove |= (mass_up_to <= 1 - top_p) & (top_p < 1)  # top_p = 1 keeps everything, exactly
    remove |= probs < batch.min_p[:, None] * probs[:, -1:]
    remove[:, -1] = False  # the best token always survives
    keep_sorted = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, keep_sorted)
