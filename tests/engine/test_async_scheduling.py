"""Async scheduling (step t+1 scheduled and prepared while step t runs) against the synchronous path: identical."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pagedq.engine import LLMEngine, RequestOutputKind
from tests.engine.helpers import TIGHT_POOLS, random_engine_traffic


def _with_more_features(requests: list[tuple], seed: int) -> list[tuple]:
    """The shared random traffic plus stop strings, logprobs, prompt logprobs and aborts (after k reported tokens)."""
    rng = random.Random(seed)
    out = []
    for kind, request_id, prompt, params, arrival, priority in requests:
        abort_after = None
        if kind == "generate":
            # Only single-sequence requests: when siblings advance relative to each other depends on the schedule.
            abort_after = rng.choice([None, 1, 2, 3]) if params.best_of == 1 else None
            params = dataclasses.replace(
                params,
                stop=rng.choice([None, None, ["e"], [" t", "a"]]),
                logprobs=rng.choice([None, 2]),
                prompt_logprobs=rng.choice([None, None, 1]),
                output_kind=RequestOutputKind.CUMULATIVE if abort_after else params.output_kind,
            )
        out.append((kind, request_id, prompt, params, arrival, priority, abort_after))
    return out


def _completion_record(output) -> list[tuple]:
    return [
        (
            c.token_ids,
            c.text,
            c.finish_reason,
            c.stop_reason,
            c.cumulative_logprob,
            [sorted(entry.items()) for entry in c.logprobs] if c.logprobs is not None else None,
        )
        for c in output.outputs
    ]


def _serve(model_dir: str, requests: list[tuple], **engine_kwargs) -> tuple[dict, dict]:
    engine = LLMEngine(model_dir, block_size=4, **engine_kwargs)
    pending, finals, step = sorted(requests, key=lambda r: r[4]), {}, 0
    abort_after = {r[1]: r[6] for r in requests if r[6]}
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][4] <= step:
            kind, request_id, prompt, params, _, priority, _ = pending.pop(0)
            add = engine.add_beam_search_request if kind == "beam" else engine.add_request
            add(request_id, prompt, params, priority=priority)
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
            elif len(output.outputs[0].token_ids) >= abort_after.get(output.request_id, 10**9):
                finals[output.request_id] = engine.abort_request(output.request_id)
        step += 1
        assert step < 5000, "no progress"
    assert engine.num_free_blocks == engine.num_total_blocks
    stats = engine.stats()
    # async: decode inputs came from the previous step's draws on the device, not from the host
    assert (stats["num_device_fed_tokens"] > 0) == engine.config.async_scheduling
    records = {rid: _completion_record(o) for rid, o in finals.items()}
    prompt_logprobs = {rid: o.prompt_logprobs for rid, o in finals.items() if o.prompt_logprobs is not None}
    return records, prompt_logprobs, stats["num_preemptions"], len(abort_after)


def _assert_same(a, b) -> None:
    """Exact tokens, text and reasons; logprobs to fp32 noise (batch composition differs between the two runs)."""
    assert a.keys() == b.keys()
    for rid in a:
        for x, y in zip(a[rid], b[rid], strict=True):
            assert x[:4] == y[:4], rid
            assert x[4] == pytest.approx(y[4], abs=1e-4), rid
            if x[5] is not None:
                for ex, ey in zip(x[5], y[5], strict=True):
                    assert [t for t, _ in ex] == [t for t, _ in ey], rid
                    assert [v for _, v in ex] == pytest.approx([v for _, v in ey], abs=1e-4), rid


@pytest.mark.parametrize("engine_kwargs", TIGHT_POOLS.values(), ids=TIGHT_POOLS.keys())
def test_async_equals_sync_on_random_mixed_traffic_under_pressure(tiny_llama_dir, engine_kwargs):
    """n / best_of, beams, seeds, greedy, penalties, top-k/p, min_tokens, stop ids and strings, logprobs, prompt
    logprobs, priorities, arrivals over time, aborts, chunked prefill, prefix caching and preemption, at once."""
    preemptions = aborts = 0
    for seed in range(4):
        requests = _with_more_features(random_engine_traffic(seed), seed)
        sync, sync_prompt, _, _ = _serve(tiny_llama_dir, requests, async_scheduling=False, **engine_kwargs)
        overlapped, overlapped_prompt, count, num_aborts = _serve(
            tiny_llama_dir, requests, async_scheduling=True, **engine_kwargs
        )
        preemptions, aborts = preemptions + count, aborts + num_aborts
        _assert_same(overlapped, sync)
        assert overlapped_prompt.keys() == sync_prompt.keys()
        for rid, entries in sync_prompt.items():
            assert [e and sorted(e) for e in overlapped_prompt[rid]] == [e and sorted(e) for e in entries], rid
    assert preemptions >= 3 and aborts >= 3
