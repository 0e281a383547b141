"""The engine's figures (`LLMEngine.stats()`): cache, scheduling, speculative decoding and step times, by name."""

from __future__ import annotations

from typing import Any

# Speculative decoding's figures, zero while it is off (the benchmarks read these names).
SPEC_STATS_OFF = {
    "num_draft_tokens": 0,
    "num_accepted_draft_tokens": 0,
    "num_grammar_cut_draft_tokens": 0,
    "num_verify_rows": 0,
    "num_spec_off_steps": 0,
}

# LoRA's figures (pagedq/engine/lora/manager.py), zero while it is off.
LORA_STATS_OFF = {"num_loras_loaded": 0, "num_lora_disk_loads": 0, "num_lora_slot_loads": 0}


def engine_stats(engine: Any) -> dict[str, float]:
    """`engine`: an engine.llm_engine.LLMEngine (not imported: that module imports this one)."""
    manager = engine.block_manager
    graphs = engine.model_runner.decode_graphs
    return {
        "blocks_saved_by_sharing": manager.num_shared_block_refs(),
        "prefix_cache_hit_rate": manager.num_prefix_hits / manager.num_prefix_queries
        if manager.num_prefix_queries
        else 0.0,
        "num_total_blocks": engine.num_total_blocks,
        "num_free_blocks": engine.num_free_blocks,
        "kv_slot_utilization": engine.kv_slot_utilization,
        "mean_kv_slot_utilization": engine.utilization_sum / engine.num_steps if engine.num_steps else 0.0,
        "num_preemptions": engine.scheduler.num_preemptions,
        "num_seat_preemptions": engine.scheduler.num_seat_preemptions,
        "num_steps": engine.num_steps,
        "num_device_fed_tokens": engine.model_runner.num_device_fed_tokens,
        "num_graph_steps": graphs.num_runs if graphs else 0,
        "peak_used_blocks": engine.peak_used_blocks,
        "num_prefilled_tokens": engine.num_prefilled_tokens,
        "num_running_requests": engine.num_running_requests,
        "num_waiting_requests": engine.num_waiting_requests,
        **(engine.speculation.stats() if engine.speculation is not None else SPEC_STATS_OFF),
        **(engine.lora.stats() if engine.lora is not None else LORA_STATS_OFF),
        **engine.step_seconds.per_step_ms(),
    }
