"""vLLM's metric names for one worker (`--metrics-compat vllm`), so dashboards and autoscaling recipes written for
vLLM (llm-d, KServe, vLLM's production stack scale on vllm:num_requests_waiting and vllm:kv_cache_usage_perc) read
a pagedq worker unchanged. Label `model_name`, as vLLM's; values from what the worker measures already:

- vllm:num_requests_running: requests in the engine's running batch;
- vllm:num_requests_waiting: requests this worker took that are not running (its engine's waiting queue and the jobs
  it read ahead); jobs nobody has read yet are the queue's lag (pagedq_queue_lag), not any one worker's;
- vllm:kv_cache_usage_perc: the fraction of KV blocks in use, 0 to 1 (vLLM's "1 means 100 percent");
- vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds: from arrival (the job's enqueue time, as the
  final record's timings count it) to the first token and to the final record of a completed job;
- vllm:prompt_tokens_total, vllm:generation_tokens_total: the final records' usage, counted as each job finishes;
- vllm:lora_requests_info: one series whose labels name the adapters of the jobs running and waiting in this worker
  (comma-joined, at most service/loras.py's MAX_SHOWN of them and "(other)") and `max_lora` (the engine's adapter
  slots), its value the time of the update, as vLLM's.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedq.worker.protocol.records import FinalRecord
from pagedq.worker.service.snapshot import WorkerSnapshot


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, buckets: tuple[float, ...]) -> None:
        label = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=registry).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=registry).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed")
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
            registry=registry,
        )
        self._lora_labels: tuple[str, str, str] | None = None

    def observe(self, record: FinalRecord) -> None:
        timings = record.timings
        if timings.ttft is not None:
            self.ttft.observe(timings.ttft)
        if record.status == "completed" and timings.total is not None:
            self.e2e.observe(timings.total)
        self.prompt_tokens.inc(record.usage.prompt_tokens)
        self.generation_tokens.inc(record.usage.completion_tokens)

    def update(self, snapshot: WorkerSnapshot) -> None:
        engine = snapshot.engine
        self.running.set(engine.running)
        self.waiting.set(max(snapshot.held_jobs - engine.running, 0))
        self.kv_usage.set(1.0 - engine.free_blocks / engine.total_blocks if engine.total_blocks else 0.0)
        rows = snapshot.loras.rows
        running = ",".join(sorted(name for name, row in rows.items() if row["running"]))
        waiting = ",".join(sorted(name for name, row in rows.items() if row["waiting"]))
        labels = (running, str(snapshot.loras.max_loras), waiting)
        if self._lora_labels is not None and self._lora_labels != labels:
            self.lora_info.remove(*self._lora_labels)  # one series: the adapters now, not every set there was
        self.lora_info.labels(*labels).set(time.time())
        self._lora_labels = labels
