"""Where a replay's wall time goes, by kind of step (`ReplayOptions.step_times`; the replay
bench prints it).

Each step of the loop is timed as a whole (the scheduler's step: batch building, memory,
results, its record and checks) and counted under one kind:

    prefill     a prefill batch was launched
    finishing   a decode batch was launched, and a result processed in the step finished a
                request (under the overlap loop, the result of the batch before)
    decode      any other decode step
    idle        no batch

What the loop does between steps (handing arrivals to the scheduler, harvesting finished
requests, draining evictions) is `between`; stack build, the final checks and the report
inputs are the rest of `summary.wall_s`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

KINDS = ("prefill", "finishing", "decode", "idle")


@dataclass
class StepTimes:
    """Steps and seconds per kind (`KINDS`), and the loop's seconds between steps."""

    steps: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    seconds: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    between_s: float = 0.0
    loop_s: float = 0.0

    def add(self, kind: str, finished: bool, seconds: float) -> None:
        if kind == "decode" and finished:
            kind = "finishing"
        elif kind not in self.steps:  # an engine's own kind of step
            self.steps[kind], self.seconds[kind] = 0, 0.0
        self.steps[kind] += 1
        self.seconds[kind] += seconds

    def add_run(self, kind: str, steps: int, seconds: float) -> None:
        """`steps` steps of one kind taken at once (a decode run), in `seconds` together."""
        self.steps[kind] += steps
        self.seconds[kind] += seconds

    def close(self, loop_s: float) -> None:
        """The loop took `loop_s`: what the steps did not take was spent between them."""
        self.loop_s = loop_s
        self.between_s = max(loop_s - sum(self.seconds.values()), 0.0)

    def per_step_us(self, kind: str) -> float:
        return 1e6 * self.seconds[kind] / self.steps[kind] if self.steps[kind] else 0.0

    def to_dict(self) -> dict:
        kinds = {kind: {"steps": self.steps[kind], "wall_s": round(self.seconds[kind], 4),
                        "us_per_step": round(self.per_step_us(kind), 1)} for kind in self.steps}
        return {"kinds": kinds, "between_steps_wall_s": round(self.between_s, 4), "loop_wall_s": round(self.loop_s, 4)}


def timed_step(step, times: StepTimes, finished: list) -> None:
    """Run `step()` (the scheduler's), counting its wall time in `times` under its kind;
    `finished` is the scheduler's list of the requests this step finished."""
    start = time.perf_counter()
    record = step()
    times.add(getattr(record, "kind", "step"), bool(finished), time.perf_counter() - start)
