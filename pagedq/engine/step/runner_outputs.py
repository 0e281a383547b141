"""From the sampler's tensors and the hidden states to the runner's answer, keyed by request id."""

from __future__ import annotations

from operator import attrgetter

import torch

from pagedq.engine.core.request import SampledToken
from pagedq.engine.core.step_plan import ModelRunnerOutput, ScheduledChunk
from pagedq.engine.sample.sampler import SamplerOutput
from pagedq.engine.step.batch_state import RowInfo

_REQ_ID = attrgetter("req_id")


def sampled_tokens(
    draw_rows: list[RowInfo], result: SamplerOutput, output: ModelRunnerOutput, verified: bool = False
) -> None:
    """One SampledToken per draw into `output.sampled` (log-probabilities where the row wants them). `verified`:
    the step verified drafts, and the draws verification rejected (token id -1) are dropped."""
    token_ids = result.token_ids.tolist()  # the step's one device->host sync
    sampled_lps = result.sampled_logprobs.tolist() if result.sampled_logprobs is not None else None
    top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
    top_ids = result.top_token_ids.tolist() if result.top_token_ids is not None else None
    if verified:
        kept = [i for i, token in enumerate(token_ids) if token >= 0]
        draw_rows, token_ids = [draw_rows[i] for i in kept], [token_ids[i] for i in kept]
        sampled_lps, top_lps, top_ids = (
            None if v is None else [v[i] for i in kept] for v in (sampled_lps, top_lps, top_ids)
        )
    sampled = output.sampled
    if sampled_lps is None:  # the common case, kept lean: it runs for every sequence every step
        get, new = sampled.get, tuple.__new__  # tuple.__new__: without the NamedTuple's Python-level __new__
        for req_id, token in zip(map(_REQ_ID, draw_rows), token_ids):
            draws = get(req_id)
            if draws is None:
                sampled[req_id] = [new(SampledToken, (token, None, None))]
            else:
                draws.append(new(SampledToken, (token, None, None)))
        return
    for i, info in enumerate(draw_rows):
        draw = SampledToken(token_ids[i])
        # the sampler returns the three together (or none)
        if info.wants_logprobs and sampled_lps is not None and top_lps is not None and top_ids is not None:
            k = info.params.logprobs or 0
            top = dict(zip(top_ids[i][:k], top_lps[i][:k]))
            top.setdefault(token_ids[i], sampled_lps[i])
            draw = SampledToken(token_ids[i], sampled_lps[i], top)
        output.sampled.setdefault(info.req_id, []).append(draw)


def prompt_logprobs(
    ordered: list[ScheduledChunk],
    infos: list[RowInfo],
    hidden: torch.Tensor,
    model,
) -> dict[str, list[dict[int, float]]]:
    """Entries j = p + 1 of the prompt log-probabilities, from the logits at each prompt position p this step
    computed that a request still lacks: log_softmax, the prompt's own token and the top-k alternatives."""
    wanted: list[tuple[RowInfo, int, int]] = []
    rows: list[int] = []
    offset = 0
    for chunk, info in zip(ordered, infos):
        if info.needs_prompt_logprobs:
            first = max(chunk.start_position, info.num_prompt_logprobs_done - 1)
            last = min(chunk.start_position + chunk.num_new_tokens, info.num_prompt_tokens - 1)
            if first < last:
                wanted.append((info, first, last))
                rows.extend(range(offset + first - chunk.start_position, offset + last - chunk.start_position))
        offset += chunk.num_new_tokens
    if not wanted:
        return {}
    logprobs = torch.log_softmax(model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)]), dim=-1)
    targets = [t for info, first, last in wanted for t in info.token_ids[first + 1 : last + 1]]
    target_lps = logprobs.gather(-1, torch.tensor(targets, device=hidden.device)[:, None])[:, 0].tolist()
    k = max(info.params.prompt_logprobs or 0 for info, _, _ in wanted)  # set: they need prompt logprobs
    if k:
        top_lps, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    else:
        top_lps = top_ids = [[]] * len(rows)
    entries, row = {}, 0
    for info, first, last in wanted:
        count, k_request = last - first, info.params.prompt_logprobs
        per_token = []
        for i in range(row, row + count):
            entry = dict(zip(top_ids[i][:k_request], top_lps[i][:k_request]))
            entry[targets[i]] = target_lps[i]
            per_token.append(entry)
        entries[info.req_id] = per_token
        info.num_prompt_logprobs_done += count
        row += count
    return entries
