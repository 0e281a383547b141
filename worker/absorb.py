"""Folding the engine's outputs into held jobs: token ids, text, logprobs, streamed deltas, finish reasons."""

from __future__ import annotations

from .engine_api import CompletionOutput, RequestOutput
from .held import HeldJob, Sample
from .publisher import Publisher

ABORTED = "the engine aborted the request"


def absorb(t: HeldJob, out: RequestOutput, now: float, publisher: Publisher) -> tuple[str, str | None] | None:
    """Add one step's output to t (and queue its deltas when it streams). Once the engine is done with it:
    the (status, error) of its final record; None while it runs."""
    t.started = True  # output came: it has left the engine's waiting queue
    t.prompt_tokens = len(out.prompt_token_ids or ())
    if t.job.n > 1:
        return _absorb_samples(t, out, now, publisher)
    c = out.outputs[0]
    if c.token_ids and t.first_token_at is None:
        t.first_token_at = now
    pos = len(t.token_ids)
    t.token_ids.extend(c.token_ids)
    t.text_parts.append(c.text)
    lps = _logprobs(c)
    if getattr(out, "prompt_logprobs", None):  # the first output brings them (JSON keys are strings)
        t.prompt_logprobs = [None if d is None else {str(k): float(v) for k, v in d.items()}
                             for d in out.prompt_logprobs]
    if lps:
        t.logprobs = (t.logprobs or []) + lps
    if t.job.stream and (c.token_ids or c.text):
        publisher.delta(t.id, c.text, list(c.token_ids), pos, lps)
    if not out.finished:
        return None
    t.finish_reason, t.stop_reason = c.finish_reason, c.stop_reason
    return ("failed", ABORTED) if c.finish_reason == "abort" else ("completed", None)


def _absorb_samples(t: HeldJob, out: RequestOutput, now: float,
                    publisher: Publisher) -> tuple[str, str | None] | None:
    """A job with n > 1: the engine's parallel samples, each kept (and streamed) under its index."""
    for c in out.outputs:
        s = t.samples.setdefault(c.index, Sample())
        if c.token_ids and t.first_token_at is None:
            t.first_token_at = now
        pos = len(s.token_ids)
        s.token_ids.extend(c.token_ids)
        s.text_parts.append(c.text)
        lps = _logprobs(c)
        if lps:
            s.logprobs = (s.logprobs or []) + lps
        if t.job.stream and (c.token_ids or c.text):
            publisher.delta(t.id, c.text, list(c.token_ids), pos, lps, index=c.index)
        if c.finish_reason is not None:
            s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason
    if not out.finished:
        return None
    adopt_first_sample(t)
    aborted = any(s.finish_reason == "abort" for s in t.samples.values())
    return ("failed", ABORTED) if aborted else ("completed", None)


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
