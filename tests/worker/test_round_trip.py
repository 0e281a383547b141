"""pagedq/worker/service/round_trip.py: writes answer by position, reads through their typed replies, all in one
pipeline."""

from __future__ import annotations

import pytest
from redis.exceptions import ResponseError

from pagedq.worker.service.round_trip import RoundTrip


class CountingPipeline:
    """A pipeline that records how often it is executed, around a real one."""

    def __init__(self, pipe) -> None:
        self.pipe, self.executions = pipe, 0

    def __getattr__(self, name):
        return getattr(self.pipe, name)

    def __len__(self) -> int:
        return len(self.pipe)

    def execute(self, **kwargs):
        self.executions += 1
        return self.pipe.execute(**kwargs)


def test_writes_by_position_reads_decoded_in_one_round_trip(r):
    trip = RoundTrip(r)
    counting = trip._pipe = CountingPipeline(trip._pipe)
    trip.write([("SET", "a", "1"), ("ZADD", "z", 1, "x")])
    size = trip.read(lambda p: p.zcard("z"), int)
    value = trip.read(lambda p: p.get("a"), lambda raw: raw.decode())
    assert trip.execute() == [True, 1]
    trip.raise_read_error()
    assert (size.value, value.value, counting.executions) == (1, "1", 1)


def test_a_refused_read_is_raised_after_the_writes_came_back(r):
    r.set("s", "text")
    trip = RoundTrip(r)
    trip.write([("SET", "w", "1")])
    ok = trip.read(lambda p: p.get("s"), bytes)
    bad = trip.read(lambda p: p.zcard("s"), int)  # WRONGTYPE
    assert trip.execute() == [True] and ok.value == b"text"
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        trip.raise_read_error()
    with pytest.raises(ResponseError):
        bad.value  # noqa: B018


def test_misuse_is_refused(r):
    trip = RoundTrip(r)
    early = trip.read(lambda p: p.zcard("z"), int)
    with pytest.raises(RuntimeError, match="before its round trip"):
        early.value  # noqa: B018
    with pytest.raises(RuntimeError, match="writes go before the reads"):
        trip.write([("SET", "a", "1")])
    with pytest.raises(RuntimeError, match="one command"):
        trip.read(lambda p: p.zcard("z").zcard("y"), int)
