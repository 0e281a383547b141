"""One pipeline sent in one round trip, its replies routed by type instead of by position.

Writes go first and answer as a list (the publisher checks them); each read is queued with a decoder and
answers through its own Reply once the trip has run. A read's command is queued by a function of the pipeline,
so redis-py builds it (and parses its reply) as it would for a direct call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_NOT_YET = object()


class Reply(Generic[T]):
    """The decoded answer of one read, there once its round trip has run; a Redis error is raised on reading."""

    __slots__ = ("_decode", "_raw")

    def __init__(self, decode: Callable[[Any], T]) -> None:
        self._decode = decode
        self._raw: Any = _NOT_YET

    @property
    def error(self) -> Exception | None:
        return self._raw if isinstance(self._raw, Exception) else None

    @property
    def value(self) -> T:
        if self._raw is _NOT_YET:
            raise RuntimeError("a reply read before its round trip ran")
        if isinstance(self._raw, Exception):
            raise self._raw
        return self._decode(self._raw)


class RoundTrip:
    def __init__(self, redis_client: Any) -> None:
        self._pipe = redis_client.pipeline(transaction=False)
        self._writes = 0
        self._reads: list[Reply[Any]] = []

    def write(self, ops: Iterable[tuple[Any, ...]]) -> None:
        """Commands whose replies come back from execute(), in order."""
        if self._reads:
            raise RuntimeError("writes go before the reads: execute() answers them by position")
        for op in ops:
            self._pipe.execute_command(*op)
            self._writes += 1

    def read(self, queue: Callable[[Any], object], decode: Callable[[Any], T]) -> Reply[T]:
        """queue(pipeline) adds exactly one command (e.g. `lambda p: p.zcard(key)`); its reply goes to decode."""
        before = len(self._pipe)
        queue(self._pipe)
        if len(self._pipe) != before + 1:
            raise RuntimeError(f"a read queues one command, this one queued {len(self._pipe) - before}")
        reply: Reply[T] = Reply(decode)
        self._reads.append(reply)
        return reply

    def execute(self) -> list[Any]:
        """Send it all; the writes' replies (errors as values); the reads' go to their Reply objects."""
        results = self._pipe.execute(raise_on_error=False)
        for reply, raw in zip(self._reads, results[self._writes :], strict=True):
            reply._raw = raw
        return results[: self._writes]

    def raise_read_error(self) -> None:
        """The first read that Redis refused, raised (after the writes were dealt with)."""
        for reply in self._reads:
            if reply.error is not None:
                raise reply.error
