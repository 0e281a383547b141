"""Folding the engine's outputs into held jobs: token ids, text, logprobs, streamed deltas, finish reasons."""

from __future__ import annotations

from pagedq.worker.service.engine_api import CompletionOutput, RequestOutput
from pagedq.worker.service.held import HeldJob, Sample
from pagedq.worker.service.publisher import Publisher

ABORTED = "the engine aborted the request"


def absorb(t: HeldJob, out: RequestOutput, now: float, publisher: Publisher) -> tuple[str, str | None] | None:
    """Add one step's output to t (and queue its deltas when it streams). Once the engine is done with it:
    the (status, error) of its final record; None while it runs.

    A job with n > 1 keeps each of the engine's parallel samples under its index (its deltas carry it); a job
    with one sample keeps it on the job itself, so its records keep their original shape."""
    t.started = True  # output came: it has left the engine's waiting queue
    t.prompt_tokens, t.cached_tokens = len(out.prompt_token_ids or ()), out.num_cached_tokens
    if out.num_preemptions > len(t.preempted_at):  # the engine took its blocks or its seat since the last output
        t.preempted_at += [now] * (out.num_preemptions - len(t.preempted_at))
    prompt_logprobs = getattr(out, "prompt_logprobs", None)
    if prompt_logprobs:  # the first output brings them (JSON keys are strings)
        t.prompt_logprobs = [None if d is None else {str(k): float(v) for k, v in d.items()} for d in prompt_logprobs]
    if t.prompt_token_ids is None and (t.job.echo or t.job.prompt_logprobs is not None):
        t.prompt_token_ids = list(out.prompt_token_ids or ())
        # a text prompt made in the prompt pool reaches the engine as token ids (service/prompt_pool.py): its text
        # is the job's own
        t.prompt_text = getattr(out, "prompt", None) or t.job.prompt or publisher.prompt_text(t.prompt_token_ids)
    several = t.job.n > 1
    for c in out.outputs:
        sample = t.samples.setdefault(c.index, Sample()) if several else t
        _fold(t, sample, c, now, publisher, c.index if several else None)
    if not out.finished:
        return None
    if several:
        adopt_first_sample(t)
    error = getattr(out, "error", None)  # e.g. its structured_outputs grammar failed
    if error is not None:  # before any token (the grammar did not compile): the job itself is bad
        generated = t.token_ids or any(s.token_ids for s in t.samples.values())
        return ("failed" if generated else "rejected", error)
    aborted = any(s.finish_reason == "abort" for s in (t.samples.values() if several else [t]))
    return ("failed", ABORTED) if aborted else ("completed", None)


def _fold(
    t: HeldJob, sample: HeldJob | Sample, c: CompletionOutput, now: float, publisher: Publisher, index: int | None
) -> None:
    """One sample's new tokens, text and logprobs; its delta when the job streams; its finish once it has one."""
    if c.token_ids and t.first_token_at is None:
        t.first_token_at = now
    pos = len(sample.token_ids)
    sample.token_ids.extend(c.token_ids)
    sample.text_parts.append(c.text)
    lps = _logprobs(c)
    if lps:
        sample.logprobs = (sample.logprobs or []) + lps
    if t.job.stream and (c.token_ids or c.text or (t.job.echo and not t.prompt_streamed)):
        publisher.delta(t, c.text, list(c.token_ids), pos, lps, index=index)
    if c.finish_reason is not None:
        sample.finish_reason, sample.stop_reason = c.finish_reason, c.stop_reason


def absorb_abort(t: HeldJob, out: RequestOutput | None) -> None:
    """The output abort_request returned (cumulative: authoritative over our deltas) becomes t's partial output."""
    if out is None or not out.outputs:
        return
    if t.job.n > 1:
        t.samples = {c.index: Sample(list(c.token_ids), [c.text], finish_reason="abort") for c in out.outputs}
        adopt_first_sample(t)
    else:
        c = out.outputs[0]
        t.token_ids, t.text_parts = list(c.token_ids), [c.text]
        t.finish_reason = "abort"


def adopt_first_sample(t: HeldJob) -> None:
    """The record's top-level output is sample 0's, so consumers that predate n > 1 still read one."""
    first = t.samples.get(0) or Sample()
    t.token_ids, t.text_parts, t.logprobs = first.token_ids, first.text_parts, first.logprobs
    t.finish_reason, t.stop_reason = first.finish_reason, first.stop_reason


def _logprobs(c: CompletionOutput) -> list[dict[str, float]] | None:
    return [{str(k): float(v) for k, v in d.items()} for d in c.logprobs] if c.logprobs else None
