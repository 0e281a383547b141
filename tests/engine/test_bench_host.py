"""`pagedq bench host`: its accounting (not its timings)."""

from __future__ import annotations

import argparse

import pytest

from pagedq.bench.engine import host as bench_host
from pagedq.bench.engine.args import add_host_arguments
from pagedq.bench.engine.throughput import _config_only_folder


def test_timeline_accounting_counts_decode_steps_only():
    timeline = bench_host.DeviceTimeline([(0.0, 5.0, False), (6.0, 8.0, True), (9.0, 11.0, True), (11.5, 13.5, True)])
    summary = timeline.summary()
    # decode spans: busy 2 + 2 + 2 over a wall of 13.5 - 6; gaps 1 and 0.5 between them
    assert summary["num_decode_steps"] == 3
    assert summary["device_busy_fraction"] == pytest.approx(6 / 7.5)
    assert summary["host_ms_per_step"] == pytest.approx(1e3 * 1.5 / 2)
    assert "forward_busy_fraction" not in summary  # CUDA spans: the device's own time
    # a stand-in of 1.5 s a forward whose spans ran 2 s (late wake-ups): the forward alone over the same wall
    stand_in = bench_host.DeviceTimeline(timeline.spans, simulated_s=1.5).summary()
    assert stand_in["forward_busy_fraction"] == pytest.approx(3 * 1.5 / 7.5)
    assert stand_in["device_busy_fraction"] == pytest.approx(6 / 7.5)
    with pytest.raises(ValueError, match="output-len"):
        bench_host.DeviceTimeline([(0.0, 1.0, True)]).summary()


@pytest.mark.parametrize("sampling", ["greedy", "penalties"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_stand_in_tokens_flow_through_the_real_engine(sampling, async_scheduling):
    """The stand-in's deterministic draws are what the engine reports (through the async placeholder feed too),
    and every decode step is one device span."""
    parser = argparse.ArgumentParser()
    add_host_arguments(parser)
    vocab, output_len = 1000, 6
    args = parser.parse_args(
        [
            "--num-seqs",
            "5",
            "--vocab-size",
            str(vocab),
            "--output-len",
            str(output_len),
            "--prompt-len",
            "20",
            "--simulated-device-ms",
            "0",
            "--sampling",
            sampling,
        ]
    )
    model_dir = str(_config_only_folder({**bench_host._STAND_IN_SHAPE, "vocab_size": vocab}))
    result = bench_host.run_mode(args, model_dir, async_scheduling)
    expected = {
        f"host-{i}": [(i + position * 7919) % (vocab - 10) + 10 for position in range(output_len)] for i in range(5)
    }
    assert result["tokens"] == expected
    assert result["num_decode_steps"] == output_len - 1  # the prefill step samples the first token
    assert 0 < result["device_busy_fraction"] <= 1
