"""How long a job waits in the worker between being read from Redis and being handed to the engine, per band:
the figure that says whether an interactive job that arrives during a step is admitted at the next one."""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from pagedq.worker.protocol.keys import BANDS
from pagedq.worker.service.held import HeldJob

KEPT = 1024  # the latest delays kept per band (the percentiles are over these)


class AdmitDelays:
    def __init__(self) -> None:
        self._recent: dict[str, deque[float]] = {band: deque(maxlen=KEPT) for band in BANDS}
        self.counts = dict.fromkeys(BANDS, 0)

    def admitted(self, t: HeldJob) -> None:
        """A job handed to the engine: its delay since it was read (a rerun is not a new read: not counted)."""
        if t.read_at:
            self.add(t.band, time.monotonic() - t.read_at)
            t.read_at = 0.0

    def add(self, band: str, seconds: float) -> None:
        self._recent[band].append(seconds)
        self.counts[band] += 1

    def summary(self) -> dict[str, dict[str, float]]:
        """Per band with admissions: their count, and the p50/p99/max of the latest KEPT delays in ms."""
        out = {}
        for band, recent in self._recent.items():
            if recent:
                ms = 1e3 * np.asarray(recent)
                out[band] = {
                    "count": self.counts[band],
                    "p50_ms": round(float(np.percentile(ms, 50)), 3),
                    "p99_ms": round(float(np.percentile(ms, 99)), 3),
                    "max_ms": round(float(ms.max()), 3),
                }
        return out
