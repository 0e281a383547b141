"""What a `pagedq bulk` run may touch and what an earlier run of it answered.

A run never writes to its input (an output or errors file that is the input, through a symlink or a hard link,
is refused before anything is opened) and never trims a file it did not create: the run's state in Redis
(QueueKeys.bulk_run) records the input its run id is bound to and the identity (device, inode) of each output file
it created, and only those lose a partly written last line on resume. Any other file is appended to after its last
line. A line of the output or errors files counts as answered only if it is this run's: its id names this run's
job for its custom_id (or, for a line that never became a job, its line number), so a forged or unrelated line
never makes a request be skipped.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pagedq.worker.protocol.connection import SyncRedis
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.protocol.replies import text

# A run id goes into Redis keys and job ids: no colons, braces or spaces.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class BulkRefused(ValueError):
    """A run that must not start; the message says why and what to do (the command exits 2, no file touched)."""


def check_run_id(run_id: str) -> str:
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise BulkRefused(f"--run-id must be 1 to 64 letters, digits, '_', '.' or '-', got {run_id!r}")
    return run_id


def check_files(input_path: Path, output_path: Path, errors_path: Path) -> None:
    """Refuses an output or errors file that is the input, or each other (after links, symbolic or hard)."""
    named = {"input": input_path, "output": output_path, "errors file": errors_path}
    pairs = (("output", "input"), ("errors file", "input"), ("errors file", "output"))
    for a, b in pairs:
        if _same_file(named[a], named[b]):
            raise BulkRefused(
                f"the {a} {named[a]} is the same file as the {b} {named[b]}: name another {a} "
                "(the run appends to it, and would read and trim what it writes)"
            )


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): not the same file
        return False


def identity(path: Path) -> str:
    """The file a path names, whatever link led to it: its device and inode."""
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}"


@dataclass
class RunState:
    """A run's record in Redis (expires with the run's enqueue record, --ttl)."""

    r: SyncRedis
    keys: QueueKeys
    run_id: str
    ttl_s: int

    @property
    def key(self) -> str:
        return self.keys.bulk_run(self.run_id)

    def bind(self, input_digest: str) -> None:
        """Ties the run id to this input; BulkRefused if it is another input's."""
        self.r.hsetnx(self.key, "input", input_digest)
        self.r.expire(self.key, self.ttl_s)
        bound = text(self.r.hget(self.key, "input") or b"")
        if bound != input_digest:
            raise BulkRefused(
                f"run id {self.run_id!r} belongs to another input (content hash {bound}, this one's is "
                f"{input_digest}): give this input its own --run-id, or none (its content hash is the default)"
            )

    def owns(self, path: Path) -> bool:
        """Whether this run created the file at `path` (only such a file may be trimmed)."""
        return path.exists() and bool(self.r.hexists(self.key, f"owns:{identity(path)}"))

    def open_append(self, path: Path) -> IO[str]:
        """`path` opened to append whole lines: created (and recorded as this run's) if it does not exist;
        a file whose last line has no newline gets one first, so its last line stays as it is."""
        created = not path.exists()
        with open(path, "a+b") as fh:
            if fh.seek(0, os.SEEK_END):
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")
        if created:
            self.r.hset(self.key, f"owns:{identity(path)}", 1)
        return open(path, "a", encoding="utf-8")


@dataclass
class Done:
    """What the output and errors files already answer for this run."""

    ids: set[str] = field(default_factory=set)  # custom_ids answered by this run's jobs
    lines: set[int] = field(default_factory=set)  # input lines answered with a line error (no job)
    foreign: int = 0  # lines that are not this run's (ignored)


def read_done(path: Path, done: Done, job_id_of: Callable[[str], str], owned: bool) -> None:
    """Adds the answers of `path` to `done`. A partly written last line (interrupted mid-write) is cut off first,
    only if this run created the file (`owned`); another file's last line is left as it is (and not counted)."""
    if not path.exists():
        return
    raw = path.read_bytes()
    if owned and raw and not raw.endswith(b"\n"):
        raw = raw[: raw.rfind(b"\n") + 1]
        path.write_bytes(raw)
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        kind, key = _answer_of(line, job_id_of)
        if kind == "id":
            done.ids.add(str(key))
        elif kind == "line":
            done.lines.add(int(key))
        else:
            done.foreign += 1


def _answer_of(line: bytes, job_id_of: Callable[[str], str]) -> tuple[str, str | int]:
    """("id", custom_id) for a job's answer, ("line", n) for a line error, ("foreign", "") for a line not this run's."""
    try:
        entry = json.loads(line)
    except ValueError:  # not JSON (or not UTF-8)
        return "foreign", ""
    if not isinstance(entry, dict) or not isinstance(row := entry.get("id"), str):
        return "foreign", ""
    custom_id, line_no = entry.get("custom_id"), entry.get("line")
    if isinstance(custom_id, str) and custom_id and row == f"batch_req_{job_id_of(custom_id)}":
        return "id", custom_id
    if type(line_no) is int and row == f"batch_req_line_{line_no}":
        return "line", line_no
    return "foreign", ""
