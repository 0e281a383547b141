"""Producer API (sync): submit jobs, stream deltas, wait for results, cancel.

    from pagedq.worker import Client
    client = Client("redis://localhost:6379/0")
    job_id = client.submit(prompt="Hello", max_tokens=32, temperature=0)
    print(client.result(job_id, timeout=60).text)

Everything here is plain Redis: a producer in another language does the same with XADD / XREAD / GET
(see the wire protocol in the README). What is not I/O lives in pagedq/worker/client/core.py, shared with
AsyncClient.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pagedq.worker.client.core import ClientCore, DeltaFilter, Entry
from pagedq.worker.protocol import scripts
from pagedq.worker.protocol.connection import SyncRedis, connect
from pagedq.worker.protocol.job import Delta, FinalRecord, Job
from pagedq.worker.protocol.settings import redis_url


class Client(ClientCore):
    def __init__(
        self,
        url: str | None = None,
        queue: str = "default",
        *,
        max_queue_depth: int | None = None,
        max_tenant_queued: int | None = None,
        job_id_prefix: str | None = None,
        redis: SyncRedis | None = None,
    ) -> None:
        super().__init__(queue, max_queue_depth, max_tenant_queued, job_id_prefix)
        # url None: PAGEDQ_REDIS_URL, else a local Redis (pagedq/worker/protocol/settings.py);
        # redis+cluster:// a cluster
        self.r = redis if redis is not None else connect(redis_url(url))

    def close(self) -> None:
        self.r.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- producing
    def submit(self, prompt: str | None = None, *, band: str | None = None, **kwargs: Any) -> str:
        """Enqueue one job; returns its id. Keywords: prompt_token_ids, messages (chat: a list of
        {"role", "content"}, rendered by the worker with the model's chat template), max_tokens, temperature,
        top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, logprobs, prompt_logprobs, stream, priority,
        deadline, metadata, job_id. band: "interactive", "default" or "bulk" (default: from priority, > 0
        interactive, < 0 bulk)."""
        return self._submit(self._one(prompt, band, kwargs))[0]

    def submit_many(self, jobs: Iterable[Job | Mapping[str, Any]]) -> list[str]:
        """Validate every job, then enqueue all in one round trip (all or none when a depth limit is set)."""
        return self._submit(self._many(jobs))

    def _submit(self, built: list[tuple[Job, str]]) -> list[str]:
        if not built:
            return []
        keys, args = self._submit_script(built)
        return self._submitted(scripts.call(self.r, "submit", keys, args), built)

    def cancel(self, job_id: str) -> bool:
        """Ask the workers to cancel a queued or running job; False (and nothing written) if it already has
        its final record or is unknown: never submitted by a client nor read by a worker yet."""
        keys, args = self._cancel_script(job_id)
        return bool(scripts.call(self.r, "cancel", keys, args))

    def queue_depth(self, band: str | None = None) -> int:
        """Jobs not yet finished (waiting plus in flight), of one band or of all."""
        return sum(int(self.r.xlen(key)) for key in self._depth_keys(band))

    # --- consuming
    def final(self, job_id: str) -> FinalRecord | None:
        return self._parse_final(self.r.get(self.keys.final(job_id)))

    def result(self, job_id: str, timeout: float | None = None) -> FinalRecord:
        """Wait for the job's final record (raises ResultTimeout)."""
        for _kind, item in self._entries(job_id, "0-0", timeout):
            if isinstance(item, FinalRecord):
                return item
        raise AssertionError("unreachable")

    def stream(self, job_id: str, offset: str = "0-0", timeout: float | None = None) -> Iterator[Delta]:
        """Yield the job's deltas as they arrive, until its final record. Resume after a disconnect with
        offset=<the last delta's .offset>. timeout bounds the wait for each next record."""
        seen = DeltaFilter()
        for _kind, item in self._entries(job_id, offset, timeout, per_item=True):
            if isinstance(item, FinalRecord):
                return
            if seen.keep(item):
                yield item

    def _entries(self, job_id: str, offset: str, timeout: float | None, per_item: bool = False) -> Iterator[Entry]:
        reader = self._reader(job_id, offset, timeout, per_item)
        while True:
            reply = self.r.xread(**reader.xread_kwargs())
            yield from reader.entries(reply)
            if not reply:
                yield from reader.when_idle(self.r.get(reader.final_key))
