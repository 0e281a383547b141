"""Where an engine step's wall time goes, phase by phase (LLMEngine.stats)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTimes:
    """Wall time spent in each phase of `step`, summed: where a step's time goes (host work vs the forward pass).

    `execute` includes input preparation, the forward pass and the sampled-token copy back to the host (the
    step's one device sync), so on a GPU `schedule` + `postprocess` is host time the device sits idle for.
    """

    num_steps: int = 0
    schedule: float = 0.0
    execute: float = 0.0
    postprocess: float = 0.0

    def add(self, schedule: float, execute: float, postprocess: float) -> None:
        self.num_steps += 1
        self.schedule += schedule
        self.execute += execute
        self.postprocess += postprocess

    def per_step_ms(self) -> dict[str, float]:
        steps = max(self.num_steps, 1)
        return {
            f"{phase}_ms_per_step": 1e3 * getattr(self, phase) / steps
            for phase in ("schedule", "execute", "postprocess")
        }
