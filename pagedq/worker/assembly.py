"""The worker as its settings describe it: the service loop with the front doors and the metrics endpoint that the
settings switch on, built here because they live above the service layer (pagedq/worker/celery/, pagedq/worker/ops/) and
the loop only knows them through its protocols (pagedq/worker/service/front_door.py, pagedq/worker/service/snapshot.py).
What the CLI, the demo, the benchmarks and the tests run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedq.worker.logs import worker_logger
from pagedq.worker.protocol.connection import refuse_cluster
from pagedq.worker.protocol.keys import model_id
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.service.engine_api import WorkerEngine, require_engine
from pagedq.worker.service.front_door import FrontDoor
from pagedq.worker.service.loop import ServiceLoop

if TYPE_CHECKING:  # both are imported only when the settings switch them on (celery is slow to import)
    from pagedq.worker.celery.intake import CeleryIntake
    from pagedq.worker.ops.metrics import Metrics


class Worker(ServiceLoop):
    celery: CeleryIntake | None  # the Celery front door, when on
    metrics: Metrics | None  # the endpoint itself (its port, its server), not only the loop's sink

    def __init__(self, engine: WorkerEngine, redis_client: Any, settings: WorkerSettings) -> None:
        require_engine(engine)  # before anything below opens a connection or a port
        doors: list[FrontDoor] = []
        self.celery = None
        if settings.celery_broker:  # kombu has no Redis Cluster transport: one line here, not a kombu traceback
            refuse_cluster("Celery's broker and backend (kombu)", settings.celery_broker, settings.celery_backend)
            from pagedq.worker.celery.intake import CeleryIntake  # celery is only imported when the front door is on

            self.celery = CeleryIntake.from_settings(settings, redis_client, worker_logger(settings.name))
            doors.append(self.celery)
        metrics: Metrics | None = None
        if settings.metrics_port is not None:
            from pagedq.worker.ops.metrics import Metrics

            metrics = Metrics(
                settings.metrics_port,
                settings.queue,
                redis_client,
                addr=settings.metrics_addr,
                every_s=settings.metrics_every_s,
                compat=settings.metrics_compat,
                model_name=model_id(settings.model),
            )
        super().__init__(engine, redis_client, settings, front_doors=doors, metrics=metrics)
