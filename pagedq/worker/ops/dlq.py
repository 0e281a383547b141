"""`pagedq dlq list|retry|purge`: the dead-letter stream of a queue.

A dead letter holds the job as it was enqueued, its last error, attempts and worker. `retry` enqueues the
job again as a fresh attempt under the same job id: the old final record and result stream are deleted in
the same atomic step as the re-enqueue, so a producer waiting on that id sees the new outcome (and the
"one final record per job id" rule holds for what is stored). `purge` deletes dead letters.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, cast

from pagedq.worker.flags import Option, add_options, queue_option
from pagedq.worker.protocol import scripts
from pagedq.worker.protocol.connection import SyncRedis, connect
from pagedq.worker.protocol.keys import BANDS, JOB_FIELD, QueueKeys
from pagedq.worker.protocol.replies import text
from pagedq.worker.protocol.settings import redis_url

OPTIONS = (
    queue_option(),
    Option("json", bool, False, "list: one JSON array of the dead letters ([] when none)"),
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "retry", "purge"], help="list, retry or purge dead letters")
    p.add_argument("job_ids", nargs="*", help="job ids to retry or purge (default with --all: every dead letter)")
    # a flag only, never a variable: an environment must not turn a retry or purge of some jobs into one of all
    p.add_argument("--all", action="store_true", help="retry/purge every dead letter")
    p.add_argument("--redis", default=None, help="Redis URL (default: $PAGEDQ_REDIS_URL or redis://localhost:6379/0)")
    add_options(p, OPTIONS)


def dead_letters(r: SyncRedis, queue: str) -> list[dict[str, Any]]:
    """Every dead letter of every band, oldest first per band: {"dead_id", "id", "band", "job", "error",
    "attempts", "worker", ...}."""
    out = []
    for band in BANDS:
        # the queue's clients decode nothing: ids and fields are bytes
        entries = cast("list[tuple[bytes, dict[bytes, bytes]]]", r.xrange(QueueKeys(queue).dead_of(band)))
        for entry_id, fields in entries:
            data = json.loads(fields[b"data"])
            out.append({"dead_id": text(entry_id), "id": text(fields[b"id"]), **data, "band": band})
    return out


def retry(r: SyncRedis, queue: str, job_ids: list[str] | None = None) -> list[str]:
    """Re-enqueue dead jobs (all, or those with the given ids); returns the ids re-enqueued."""
    k, done = QueueKeys(queue), []
    newest = {letter["id"]: letter for letter in _select(r, queue, job_ids)}  # a job may have died twice
    for letter in newest.values():
        if letter.get("job") is None:  # a raw dead letter (not even a valid job): nothing to re-run
            continue
        job_json = json.dumps(letter["job"])
        band = letter["band"]  # back into the band it came from
        keys = [k.dead_of(band), k.jobs_of(band), k.final(letter["id"]), k.result(letter["id"]), k.ids]
        if scripts.call(r, "dlq_retry", keys, [letter["dead_id"], job_json, JOB_FIELD, letter["id"]]):
            done.append(letter["id"])
    return done


def purge(r: SyncRedis, queue: str, job_ids: list[str] | None = None) -> int:
    """Delete dead letters (all, or those with the given ids); returns how many."""
    k, purged = QueueKeys(queue), 0
    for letter in _select(r, queue, job_ids):
        purged += int(r.xdel(k.dead_of(letter["band"]), letter["dead_id"]))
    return purged


def _select(r: SyncRedis, queue: str, job_ids: list[str] | None) -> list[dict[str, Any]]:
    letters = dead_letters(r, queue)
    if job_ids:
        wanted = set(job_ids)
        missing = wanted - {letter["id"] for letter in letters}
        if missing:
            raise KeyError(f"no dead letter for job id(s): {', '.join(sorted(missing))}")
        letters = [letter for letter in letters if letter["id"] in wanted]
    return letters


def run(args: argparse.Namespace) -> int:
    r = connect(redis_url(args.redis))
    if args.action == "list":
        letters = dead_letters(r, args.queue)
        if args.json:  # one document, so an empty queue still parses: []
            print(json.dumps(letters))
        else:
            for letter in letters:
                print(_line(letter))
        return 0
    if not args.job_ids and not args.all:
        raise SystemExit(f"pagedq dlq {args.action}: give job ids or --all")
    ids = args.job_ids or None
    try:
        if args.action == "retry":
            print(f"re-enqueued {len(done := retry(r, args.queue, ids))}: {' '.join(done)}".rstrip(": "))
        else:
            print(f"purged {purge(r, args.queue, ids)}")
    except KeyError as exc:
        raise SystemExit(f"pagedq dlq {args.action}: {exc.args[0]}") from None
    return 0


def _line(letter: dict[str, Any]) -> str:
    job = letter.get("job") or {}
    prompt = job.get("prompt") or (
        f"<{len(job['prompt_token_ids'])} token ids>"
        if job.get("prompt_token_ids")
        else f"<{len(job.get('messages') or [])} messages>"
    )
    return (
        f"{letter['id']}  attempts={letter.get('attempts')}  worker={letter.get('worker')}  "
        f"prompt={prompt[:40]!r}\n    error: {letter.get('error')}"
    )
