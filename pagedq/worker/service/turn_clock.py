"""Where the loop's turns go, in wall seconds: the round trip to Redis, admission, the engine's step call, folding
its outputs into held jobs (and queueing their records), and the rest (timers, front doors, deadlines).

With async scheduling the engine's step call is mostly a wait for the device: the step launched in it runs on the
device (on a CPU, the engine's device thread) while the loop does everything else, so the loop costs the engine
nothing as long as the other parts of a turn take less than a device step. `pagedq bench worker` reports these
per engine step next to the device's busy fraction. A few perf_counter calls per turn: always on.
"""

from __future__ import annotations

import time

PARTS = ("round_trip", "admit", "engine_step", "outputs", "other")


class TurnClock:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.turns = 0
        self._mark = 0.0

    def start(self) -> None:
        self.turns += 1
        self._mark = time.perf_counter()

    def lap(self, part: str) -> None:
        """The time since the last mark goes to `part`."""
        now = time.perf_counter()
        self.seconds[part] += now - self._mark
        self._mark = now

    def per_step_ms(self, steps: int) -> dict[str, float]:
        return {part: round(1e3 * s / max(steps, 1), 3) for part, s in self.seconds.items()}
