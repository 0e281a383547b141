"""The per-adapter metrics of LoRA jobs (pagedq/worker/ops/metrics.py exports them; issue 36).

Series are labelled by adapter name, at most service/loras.py's MAX_SHOWN of them (the busiest) plus "(other)": a
queue serving 1,000 adapters does not become 4,000 series. Series of adapters that left the top are dropped. vLLM's
`vllm:lora_requests_info` (under --metrics-compat vllm) is ops/vllm_metrics.py's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from pagedq.worker.service.snapshot import WorkerSnapshot

# figure of service/loras.py -> (metric, help)
LORA_GAUGES = {
    "waiting": ("pagedq_lora_waiting_jobs", "Jobs of the LoRA adapter held, not in the engine"),
    "running": ("pagedq_lora_engine_jobs", "Jobs of the LoRA adapter in the engine"),
    "requests": ("pagedq_lora_admitted_jobs", "Jobs of the LoRA adapter admitted since start"),
    "tokens": ("pagedq_lora_generated_tokens", "Tokens generated with the LoRA adapter since start"),
}


class LoraMetrics:
    def __init__(self, reg: CollectorRegistry, queue: str) -> None:
        self.queue = queue
        self.gauges = {
            key: Gauge(name, doc, ["queue", "lora"], registry=reg) for key, (name, doc) in LORA_GAUGES.items()
        }
        self._shown: set[str] = set()

    def update(self, snapshot: WorkerSnapshot) -> None:
        shown = snapshot.loras.rows
        for gone in self._shown - shown.keys():
            for gauge in self.gauges.values():
                gauge.remove(self.queue, gone)
        for name, figures in shown.items():
            for key, gauge in self.gauges.items():
                gauge.labels(self.queue, name).set(figures[key])
        self._shown = set(shown)
