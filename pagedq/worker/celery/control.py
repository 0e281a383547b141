"""Celery's broadcast control commands for the pagedq worker: `revoke` (and `ping`, so it answers
`app.control.ping()` / `celery inspect ping`).

Celery sends them to every worker over the pidbox (a kombu fanout exchange, `celery.pidbox`: a Redis
PUBLISH). The worker subscribes through a kombu mailbox Node of its own, and drains it without blocking
once per loop turn (`drain`), so a revoke takes effect within a turn (50 ms when idle).

A revoke becomes a pagedq cancel: the task ids are added to the queue's cancel set, the same sorted set
`Client.cancel` writes and every worker checks its held jobs against each turn (and each job it reads,
before admission). So a running job stops at once (its final record says `cancelled`), and a message
not yet received is discarded when any worker reads it, later, by any worker, also after a restart.
Celery keeps its revoked set in each worker's memory (capped at 50000 ids, for 3 hours); this one is
shared and durable in Redis, capped at the same count (oldest dropped first) and trimmed after
`result_ttl_s` with the other cancel requests. A revoke published while no pagedq worker is subscribed is
lost, as it is for Celery's own workers.

The result backend: the worker holding the job stores REVOKED when it settles the cancelled job
(CeleryIntake.settle). A task no worker has read yet (no final record, not in the ids hash) is marked
REVOKED at once, if still PENDING, as Celery's `revoke` handler does; every worker receiving the
broadcast may write that same state. `terminate=True` and the signal change nothing: a pagedq cancel
always stops generation at once (Celery stops only a task that has not started, unless terminate).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from celery import Celery, states
from celery.utils.functional import maybe_list

from pagedq.worker.protocol.job import valid_job_id
from pagedq.worker.protocol.keys import QueueKeys

REVOKES_MAX = 50_000  # Celery's worker keeps at most this many revoked ids (CELERY_WORKER_REVOKES_MAX)
MAX_MESSAGES_PER_DRAIN = 100  # a flood of broadcasts must not starve the engine of its step
RECONNECT_AFTER_S = 1.0  # after a broken subscription, wait this long before subscribing again


class ControlListener:
    """The worker's node in Celery's pidbox: revoke and ping, nothing else (other commands are ignored)."""

    def __init__(self, app: Celery, redis_client: Any, keys: QueueKeys, hostname: str, log: Any) -> None:
        self.app, self.r, self.keys, self.hostname = app, redis_client, keys, hostname
        self.log = log.bind(celery_node=hostname)
        self.handlers = {"revoke": self._revoke, "ping": self._ping}
        self.conn: Any = None
        self.node: Any = None
        self._retry_at = 0.0
        self._revoked = False  # a revoke arrived since the last drain
        self._subscribe()

    def _subscribe(self) -> None:
        self.conn = self.app.connection_for_read()
        channel = self.conn.default_channel
        self.node = self.app.control.mailbox(self.conn).Node(self.hostname, handlers=self.handlers, channel=channel)
        self.node.listen(callback=self._on_message)
        # kombu subscribes on the first drain: do it now, so no revoke sent after __init__ is missed
        with contextlib.suppress(TimeoutError):
            self.conn.drain_events(timeout=0)

    def drain(self) -> bool:
        """Handle the control messages that arrived, without blocking. True if any revoke came in."""
        if self.conn is None:  # the subscription broke: try again once in a while
            if time.monotonic() < self._retry_at:
                return False
            try:
                self._subscribe()
            except Exception as exc:
                self._broken(exc)
                return False
        try:
            for _ in range(MAX_MESSAGES_PER_DRAIN):
                self.conn.drain_events(timeout=0)
        except TimeoutError:  # nothing (more) to read (socket.timeout)
            pass
        except Exception as exc:  # broker gone: revokes published meanwhile are lost (as for Celery's workers)
            self._broken(exc)
        revoked, self._revoked = self._revoked, False
        return revoked

    def _broken(self, exc: BaseException) -> None:
        self.log.error("celery_control_lost", error=repr(exc))
        self.close()
        self._retry_at = time.monotonic() + RECONNECT_AFTER_S

    def _on_message(self, body: Any, message: Any) -> None:
        if not isinstance(body, dict) or body.get("method") not in self.handlers:
            return  # another command for Celery's workers (inspect, rate_limit, ...): not ours to answer
        self.node.handle_message(body, message)  # honours destination/pattern, replies when asked

    def _ping(self, state: object, **_kwargs: object) -> dict:
        return {"ok": "pong"}

    def _revoke(
        self, state: object, task_id: Any = None, terminate: bool = False, signal: object = None, **_kwargs: object
    ) -> dict:
        """Celery's `revoke` handler, mapped to a pagedq cancel (see the module docstring)."""
        ids = sorted({i for i in maybe_list(task_id) or [] if isinstance(i, str) and valid_job_id(i)})
        if not ids:  # ids outside the job id grammar name no pagedq job
            return {"ok": "no pagedq task ids"}
        self._revoked = True
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(self.keys.cancelled, {job_id: time.time() for job_id in ids})
        pipe.zremrangebyrank(self.keys.cancelled, 0, -(REVOKES_MAX + 1))  # bounded, like Celery's set
        for job_id in ids:
            pipe.exists(self.keys.final(job_id))
            pipe.hexists(self.keys.ids, job_id)
        replies = pipe.execute()[2:]
        # read by no worker yet: nobody else will settle it before its message is read, so say REVOKED now
        unseen = [job_id for i, job_id in enumerate(ids) if not replies[2 * i] and not replies[2 * i + 1]]
        for job_id in unseen:
            try:
                if self.app.backend.get_state(job_id) == states.PENDING:
                    self.app.backend.mark_as_revoked(job_id, reason="revoked", store_result=True)
            except Exception as exc:  # the cancel set has it: the worker reading it still settles it REVOKED
                self.log.error("celery_result_store_failed", job_id=job_id, error=repr(exc))
        self.log.info("celery_revoked", task_ids=ids, terminate=bool(terminate))
        return {"ok": f"tasks {', '.join(ids)} flagged as revoked"}

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.release()
            except Exception as exc:
                self.log.error("celery_close_failed", error=repr(exc))
        self.conn = self.node = None
