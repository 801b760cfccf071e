"""The scheduler's progress guard: a replay that stops advancing ends with a message, not a hang.

A step made progress when a request arrived, computed a token, finished or was aborted. The
guard raises `StalledError` at once when the simulated clock is not finite or went back, and
after `MAX_STALLED_STEPS` steps in a row without progress. Reads the scheduler; changes nothing.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from memcli.errors import StalledError

# Far above any legitimate run of steps in which no request advances.
MAX_STALLED_STEPS = 1000


class Marks(NamedTuple):
    """What changes when some request advances (compared before and after a step)."""

    clock_ms: float
    pending: int
    allocated_tokens: int
    finished: int
    aborted: int


class ProgressGuard:
    def __init__(self, max_stalled_steps: int = MAX_STALLED_STEPS):
        self.max_stalled_steps = max_stalled_steps
        self.stalled_steps = 0

    @staticmethod
    def marks(sched) -> Marks:
        s = sched.stats
        return Marks(sched.clock_ms, len(sched.pending), s.allocated_tokens, s.finished, s.aborted)

    def after_step(self, sched, before: Marks) -> None:
        """Raise `StalledError` when `sched` (just stepped from `before`) has stopped advancing."""
        clock = sched.clock_ms
        if not math.isfinite(clock) or clock < before.clock_ms:
            raise StalledError(stall_message(sched, f"the simulated clock went from {before.clock_ms} to {clock} ms"))
        now = self.marks(sched)
        self.stalled_steps = self.stalled_steps + 1 if now[1:] == before[1:] else 0
        if self.stalled_steps >= self.max_stalled_steps:
            raise StalledError(stall_message(sched, f"no request made progress in {self.stalled_steps} steps"))


def stall_message(sched, what: str) -> str:
    """Where the scheduler stands: step, clock, queues and pool."""
    u = sched.memory.usage()
    return (f"scheduler stalled at step {sched.step_count}, clock {sched.clock_ms:.3f} ms: {what};"
            f" waiting {len(sched.waiting)}, running {len(sched.running.reqs)},"
            f" chunked {int(sched.chunked_req is not None)}, not yet arrived {len(sched.pending)};"
            f" free {u.available} tokens, evictable {u.evictable}, protected {u.protected}")
