"""The Celery front door: producers use Celery as usual, the pagedq worker serves the queue.

    from pagedq.worker.celery.app import generate
    record = generate.delay(prompt="What is the capital of France?", max_tokens=32, temperature=0).get(timeout=60)
    record["text"], record["status"]          # the same dict as the native final record

`pagedq worker --celery` consumes the Celery queue itself (pagedq/worker/celery/intake.py): messages join the
same continuous-batching admission as native jobs, and each one is acknowledged only after its result is
in the result backend. `AsyncResult.revoke()` cancels the job, queued or running (state REVOKED; so does
an `expires` that passes: pagedq/worker/celery/control.py). Do not start a Celery worker (`celery -A ... worker`)
for this queue: the task body below only explains that.

Configuration (environment, read when this module is imported; make_app() takes explicit values):
CELERY_BROKER_URL / CELERY_RESULT_BACKEND, else PAGEDQ_REDIS_URL, else redis://localhost:6379/0 for both;
PAGEDQ_CELERY_QUEUE (default "pagedq"; a comma list names the queues a worker serves, the first is where
this app routes the task); PAGEDQ_CELERY_VISIBILITY_TIMEOUT (seconds, default 3600).

A producer with an app of its own routes the task to the worker's queue (Celery's default queue is
`celery`, which the worker serves only when told to: `--celery-queue pagedq,celery`):

    producer = Celery("x", broker=URL, backend=URL, task_routes={"pagedq.generate": {"queue": "pagedq"}})
    producer.send_task("pagedq.generate", kwargs={"prompt": "Hi", "max_tokens": 16}).get(timeout=60)
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import before_task_publish

from pagedq.worker.protocol.trace_context import current_fields

TASK_NAME = "pagedq.generate"
DEFAULT_QUEUE = "pagedq"
# kombu's Redis transport redelivers a message not acked within this many seconds to any consumer (there
# is no lease renewal and no delivery counter). Keep it above the longest job's queue wait + run time.
DEFAULT_VISIBILITY_TIMEOUT_S = 3600.0


def default_broker_url() -> str:
    return os.environ.get("CELERY_BROKER_URL") or os.environ.get("PAGEDQ_REDIS_URL") or "redis://localhost:6379/0"


def parse_queues(value: str | None) -> list[str]:
    """The Celery queue names of a `-Q`-style comma list (default: PAGEDQ_CELERY_QUEUE, else "pagedq")."""
    value = value or os.environ.get("PAGEDQ_CELERY_QUEUE") or DEFAULT_QUEUE
    names = [name.strip() for name in value.split(",")]
    if not all(names):
        raise ValueError(f"Celery queue list {value!r} has an empty name: give names separated by commas")
    if len(set(names)) != len(names):
        raise ValueError(f"Celery queue list {value!r} names a queue twice")
    return names


def make_app(
    broker_url: str | None = None,
    *,
    backend_url: str | None = None,
    queue: str | None = None,
    visibility_timeout_s: float | None = None,
) -> Celery:
    """A Celery app for the pagedq queue with the `pagedq.generate` task registered."""
    broker = broker_url or default_broker_url()
    backend = backend_url or os.environ.get("CELERY_RESULT_BACKEND") or broker
    queue = parse_queues(queue)[0]
    if visibility_timeout_s is None:
        visibility_timeout_s = float(os.environ.get("PAGEDQ_CELERY_VISIBILITY_TIMEOUT") or DEFAULT_VISIBILITY_TIMEOUT_S)
    app = Celery("pagedq", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],  # never unpickle
        task_routes={TASK_NAME: {"queue": queue}},  # only this task: the app may carry other tasks
        # the consumer and the producers must agree on it (the producer's value is what Celery's
        # own workers would use; the pagedq worker uses its app's value)
        broker_transport_options={"visibility_timeout": visibility_timeout_s},
        result_backend_transport_options={"visibility_timeout": visibility_timeout_s},
        broker_connection_retry_on_startup=True,
    )

    # shared=False: a shared task would be added to every Celery app created later in the process
    @app.task(name=TASK_NAME, bind=True, shared=False)
    def generate(self, prompt: str | None = None, **job: object) -> dict:
        """Generate text. Keywords are the job fields of the wire protocol (prompt, prompt_token_ids,
        messages, max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos,
        include_stop_str_in_output, logit_bias (token id, a string key in Celery's JSON, -> bias), n, best_of,
        logprobs, prompt_logprobs, echo, structured_outputs (json | json_object | regex | choice | grammar), stream,
        priority, deadline, metadata); the task id is the job id.
        Returns the final record."""
        raise RuntimeError(
            f"{TASK_NAME} is served by `pagedq worker --celery` (continuous batching), not by a "
            f"Celery worker pool: stop this Celery worker from consuming queue {queue!r}"
        )

    return app


def trace_headers(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """A `pagedq.generate` message carries its producer's trace context in its headers (W3C traceparent and
    tracestate, where the producer traces and OpenTelemetry's Celery instrumentation has not put them there):
    the worker's spans of the job continue that trace (pagedq/worker/celery/intake.py)."""
    if headers is not None and "traceparent" not in headers:
        headers.update(current_fields())


# Celery's signals are process-wide: the sender (the task name) limits this to pagedq's task, in every app
before_task_publish.connect(trace_headers, sender=TASK_NAME, weak=False, dispatch_uid="pagedq.trace_headers")


def queue_of(app: Celery) -> str:
    """The Celery queue `pagedq.generate` is routed to on this app."""
    return app.conf.task_routes[TASK_NAME]["queue"]


app = make_app()
generate = app.tasks[TASK_NAME]
