"""Seat preemption: a waiting sequence of higher priority takes the seat of a running lower-priority one.

KV preemption (Scheduler._allocate_or_preempt) frees blocks; this frees seats (max_num_seqs). Without it a request
of a high band waits behind a full set of bulk sequences until one of them ends, which takes as long as that one's
whole output. The victim is preempted as for KV blocks (recompute or swap) and resumes with identical output.

Bounded, so the lower priorities are not thrashed:
- a sequence that has held its seat for fewer than `interval` steps keeps it: a seat changes hands by preemption at
  most once per `interval` steps, and every victim advanced that many steps since it was last admitted;
- a sequence preempted for its seat `max_count` times keeps its seat from then on.

Priorities are vLLM's: a lower value is served sooner, so a waiting request takes the seat of one of a higher value.

Victims: the lowest priority (the highest value) first, among equals the most recently admitted (the least work
thrown away). Never a beam (its group runs as a whole) nor a sequence still to fan out (its samples fork from its
blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from pagedq.engine.core.request import Request

MAX_SEAT_PREEMPTION_INTERVAL = 1_000_000  # steps; a bound so a typo is an error, not an overflow
MAX_SEAT_PREEMPTIONS = 1_000


@dataclass(frozen=True)
class SeatPolicy:
    interval: int = 4  # steps a sequence holds its seat before it may lose it; 0 turns seat preemption off
    max_count: int = 2  # times one sequence may lose its seat

    def __post_init__(self) -> None:
        for name, high in (("interval", MAX_SEAT_PREEMPTION_INTERVAL), ("max_count", MAX_SEAT_PREEMPTIONS)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
                raise ValueError(f"seat preemption {name} must be an integer in [0, {high}], got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.interval > 0 and self.max_count > 0

    def may_lose_seat(self, request: Request, step: int) -> bool:
        return (
            step - request.seat_since_step >= self.interval
            and request.num_seat_preemptions < self.max_count
            and not request.is_beam
            and not request.fan_out
        )


def seats_of(group: Sequence[Request]) -> int:
    """Seats a waiting group takes when admitted: one per sequence, and one per sample it will fork."""
    return len(group) + sum(r.fan_out for r in group)


def waiting_groups(ordered: Sequence[Request]) -> Iterator[list[Request]]:
    """A waiting queue in admission order, as the groups admitted together (a beam group, or one request)."""
    seen: set[str] = set()
    for request in ordered:
        if not request.is_beam:
            yield [request]
        elif request.group_id not in seen:
            seen.add(request.group_id)
            yield [r for r in ordered if r.group_id == request.group_id]


def seat_victims(
    running: Sequence[Request],
    waiting_groups: Iterable[Sequence[Request]],
    free_seats: int,
    step: int,
    policy: SeatPolicy,
) -> list[Request]:
    """The running sequences to preempt so the waiting groups (in admission order) that outrank them get seats.

    A group is served whole or not at all, and the first one that cannot be (no victim of lower priority left)
    ends the search: a lower-priority group must not overtake it (the admission queue's head-of-line rule)."""
    if not policy.enabled:
        return []
    # Lowest priority (highest value) first; among equals the most recently admitted (running is in admission
    # order, and the sort is stable).
    candidates = sorted((r for r in reversed(running) if policy.may_lose_seat(r, step)), key=lambda r: -r.priority)
    chosen: list[Request] = []
    for group in waiting_groups:
        if len(chosen) == len(candidates):
            break
        need = seats_of(group)
        priority = group[0].priority
        taken = 0
        while free_seats + taken < need and len(chosen) + taken < len(candidates):
            if candidates[len(chosen) + taken].priority <= priority:  # it does not rank below the group
                return chosen
            taken += 1
        if free_seats + taken < need:
            return chosen
        chosen += candidates[len(chosen) : len(chosen) + taken]
        free_seats += taken - need
    return chosen
