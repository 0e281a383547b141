"""Every Redis key and name the queue uses, in one place (the wire protocol's key layout).

All keys of one queue share the hash tag ``{queue}`` so they live in one Redis Cluster slot: the Lua
scripts touch several of them atomically, which Cluster only allows within a slot. Shard by queue.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PREFIX = "pagedq"
# A queue name goes inside a Redis Cluster hash tag (pagedq:{Q}:...): no braces, colons or spaces.
QUEUE_PATTERN = r"^[^{}:\s]{1,100}$"
GROUP = "workers"  # the consumer group every worker of a queue joins
# Members of the workers set (QueueKeys.workers) last beating longer ago than this are forgotten: the gateway
# does not look them up, the metrics do not export them (a crashed worker stays in the set until then).
WORKER_SET_WINDOW_S = 3600.0
JOB_FIELD = "job"  # the job stream entry field holding the job's JSON
TYPE_FIELD = "type"  # result stream entries: "delta" or "final"
DATA_FIELD = "data"  # result stream entries: the JSON payload
# Priority bands, highest first: one job stream each. "default" is the stream queues had before bands
# (`pagedq:{Q}:jobs`), so jobs already queued there are served as they are.
BANDS = ("interactive", "default", "bulk")
DEFAULT_BAND = "default"


def band_for_priority(vllm_priority: int) -> str:
    """The band a priority in vLLM's sense (Job.vllm_priority) sends a job to when no band is named: < 0
    interactive, > 0 bulk (in the job field's own sense: > 0 interactive, < 0 bulk)."""
    return "interactive" if vllm_priority < 0 else "bulk" if vllm_priority > 0 else DEFAULT_BAND


_RANKS = {band: rank for rank, band in enumerate(BANDS)}


def band_rank(band: str) -> int:
    """0 for the highest band (ValueError for an unknown one)."""
    try:
        return _RANKS[band]
    except KeyError:
        raise ValueError(f"{band!r} is not a band") from None


def check_band(band: str) -> str:
    if band not in BANDS:
        raise ValueError(f"band must be one of {', '.join(BANDS)}, got {band!r}")
    return band


@dataclass(frozen=True)
class QueueKeys:
    """Key names of one queue. Build with ``QueueKeys("default")``."""

    queue: str = "default"

    def __post_init__(self) -> None:
        if not self.queue or any(c in self.queue for c in "{}: \t\n"):
            raise ValueError(f"queue name must be non-empty without braces, colons or spaces, got {self.queue!r}")

    @property
    def base(self) -> str:
        return f"{PREFIX}:{{{self.queue}}}"

    @property
    def jobs(self) -> str:
        """Stream of pending jobs (consumer group GROUP). Entries are deleted once acknowledged."""
        return f"{self.base}:jobs"

    def jobs_of(self, band: str) -> str:
        """The job stream of a band (the default band's is `jobs`, the stream of queues before bands)."""
        return self.jobs if check_band(band) == DEFAULT_BAND else f"{self.base}:jobs:{band}"

    def dead_of(self, band: str) -> str:
        """The dead-letter stream of a band (the default band's is `dead`)."""
        return self.dead if check_band(band) == DEFAULT_BAND else f"{self.base}:dead:{band}"

    def tenant_queued(self, tenant: str) -> str:
        """Set of a tenant's job ids submitted under a per-tenant limit and maybe unfinished (scripts.SUBMIT)."""
        return f"{self.base}:tenant:{tenant}:queued"

    @property
    def completions(self) -> str:
        """Capped stream of every final record of the queue (MAXLEN ~)."""
        return f"{self.base}:completions"

    @property
    def dead(self) -> str:
        """Dead-letter stream: jobs that failed max_attempts times, with their last error."""
        return f"{self.base}:dead"

    @property
    def cancelled(self) -> str:
        """Sorted set of cancel requests: member job id, score the unix time of the request."""
        return f"{self.base}:cancelled"

    @property
    def ids(self) -> str:
        """Hash of unfinished job ids (field: job id), set by Client.submit and by a worker reading the job,
        removed with the final record: what lets Client.cancel tell an unknown id from a queued one."""
        return f"{self.base}:ids"

    @property
    def runs(self) -> str:
        """Hash: job id -> times the job was started alone (as a suspect), written before each such run, so
        a job that kills its worker while alone is charged for it; removed with the final record."""
        return f"{self.base}:runs"

    @property
    def workers(self) -> str:
        """Sorted set of worker names, scored by their last heartbeat (unix time)."""
        return f"{self.base}:workers"

    @property
    def celery_deliveries(self) -> str:
        """Hash: Celery task id -> times a worker received it (Celery on Redis has no delivery counter)."""
        return f"{self.base}:celery:deliveries"

    def bulk_enqueued(self, run_id: str) -> str:
        """Set of job ids a `pagedq bulk` run has enqueued (makes its enqueue idempotent across restarts)."""
        return f"{self.base}:bulk:{run_id}:enqueued"

    def bulk_run(self, run_id: str) -> str:
        """Hash of a `pagedq bulk` run's state: the input it is bound to (field `input`: its content hash) and the
        output files it created (field `owns:<device>:<inode>`), the only ones a resume may trim."""
        return f"{self.base}:bulk:{run_id}:state"

    def file(self, file_id: str) -> str:
        """Hash of one file of the gateway's Files API: fields meta (JSON), owner (gateway/owners.py), and content (its
        bytes) or, for a batch's output and error files, lines and bytes (the running size of its line list)."""
        return f"{self.base}:file:{file_id}"

    def file_lines(self, file_id: str) -> str:
        """List of the lines of a file a batch writes as it goes (its output or error file); expires with its file."""
        return f"{self.base}:file:{file_id}:lines"

    def owner_files(self, owner: str) -> str:
        """Sorted set of an owner's uploaded files (member: file id, score: its expiry in unix ms): the count of
        its file quota. The owner comes last (it may hold colons), so no two owners share a key."""
        return f"{self.base}:files-of:{owner}"

    def owner_file_bytes(self, owner: str) -> str:
        """Hash of an owner's uploaded files' sizes (field: file id) and their sum (field: total): the bytes of its
        file quota."""
        return f"{self.base}:file-bytes-of:{owner}"

    def owner_file_index(self, owner: str) -> str:
        """Sorted set of every file an owner has (uploads and its batches' output and error files; member: file id,
        score: its expiry in unix ms): what GET /v1/files lists, pruned of expired ids as it is read and written."""
        return f"{self.base}:file-index-of:{owner}"

    def owner_batches(self, owner: str) -> str:
        """Sorted set of an owner's batches (member: batch id, score: its expiry in unix ms): what GET /v1/batches
        lists, pruned of expired ids as it is read and written."""
        return f"{self.base}:batches-of:{owner}"

    def batch(self, batch_id: str) -> str:
        """Hash of one batch of the gateway's Batch API: its OpenAI batch object's fields (JSON-encoded) and owner."""
        return f"{self.base}:batch:{batch_id}"

    def batch_answered(self, batch_id: str) -> str:
        """Set of the custom_ids (or "line:<n>" for lines without one) a batch has written a line for; expires with
        its batch."""
        return f"{self.base}:batch:{batch_id}:answered"

    def batch_runner(self, batch_id: str) -> str:
        """A gateway's lease on running a batch (expires unless renewed: another gateway takes over)."""
        return f"{self.base}:batch:{batch_id}:runner"

    def result(self, job_id: str) -> str:
        """Per-job result stream: delta records (if streamed), then exactly one final record."""
        return f"{self.base}:result:{job_id}"

    def reader_wake(self, reader_id: str) -> str:
        """A stream one gateway's shared result reader blocks on with the result streams it waits for: an entry
        added here ends its blocking read, so a new waiter joins the next read (expires with its gateway)."""
        return f"{self.base}:reader:{reader_id}:wake"

    def final(self, job_id: str) -> str:
        """The job's final record as a JSON string; its existence means "finished" (set once, atomically)."""
        return f"{self.base}:final:{job_id}"

    def tokenizer(self, model_id: str) -> str:
        """Hash of a model's tokenizer files (and `digest`, `max_model_len`, `chars_per_token`), published by its
        workers at start for the gateway's /tokenize and /detokenize, and its prompt size check."""
        return f"{self.base}:tokenizer:{model_id}"

    @property
    def loras(self) -> str:
        """Hash of the LoRA adapters registered at run time (the gateway's /v1/load_lora_adapter): name -> JSON
        {"path", "added_at"}; every worker of the queue reads it, loading an adapter from its path on first use and
        dropping the ones that leave it (service/loras.py)."""
        return f"{self.base}:loras"

    @property
    def loras_version(self) -> str:
        """Counter bumped with every change of the registry: a worker rereads the registry only when it moved."""
        return f"{self.base}:loras:version"

    def heartbeat(self, worker: str) -> str:
        """A worker's heartbeat: JSON status, expires unless refreshed."""
        return f"{self.base}:worker:{worker}"


def model_id(model: str) -> str:
    """The id a model is served under: a checkpoint folder's name (the worker reports its path)."""
    return os.path.basename(model.rstrip("/")) or model
