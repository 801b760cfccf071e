"""Measuring one phase: first call (compile), host-device syncs, then the timed repeats.

Every phase is a zero-argument function that mutates the stack, paired with a `setup` that
puts the stack back into the state the phase starts from. `measure` runs `setup` before every
call (untimed), so the first call, the sync count and each timed repeat all see the same
state; after `measure` returns, the stack is in the state after one call of the phase.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from memcli.timing import count_syncs, time_call, wall_time

Fn = Callable[[], object]


def _noop() -> None:
    return None


@dataclass(frozen=True)
class PhaseTiming:
    """One phase: median and min of the timed calls (µs), the first call (ms), syncs per call.

    `syncs` is None on a CPU (no device to synchronise with).
    """

    median_us: float
    min_us: float
    samples: int
    method: str
    first_call_ms: float
    syncs: Optional[int]
    device_us: Optional[float] = None  # median device time (the call queued behind a busy stream)

    def to_dict(self) -> dict:
        return {"median_us": self.median_us, "min_us": self.min_us, "device_us": self.device_us,
                "samples": self.samples, "method": self.method, "first_call_ms": self.first_call_ms,
                "syncs": self.syncs}


def measure(fn: Fn, device: torch.device, repeat: int, warmup: int, setup: Fn = _noop,
            first_call_s: Optional[float] = None) -> PhaseTiming:
    """Time `fn` after `setup`; see the module docstring for the order of calls.

    `first_call_s`: the phase's first call was already made (and timed) by the caller.
    """
    if first_call_s is None:
        setup()
        first_call_s = wall_time(fn, device)
    setup()
    syncs = count_syncs(fn, device)
    timing = time_call(fn, device, repeat=repeat, warmup=warmup, setup=setup)
    # A call that syncs waits for the spin ahead of it: its device time would count host time.
    device_us = timing.device_us if not syncs else None
    return PhaseTiming(timing.median_us, timing.min_us, timing.samples, timing.method, first_call_s * 1e3, syncs,
                       device_us)


def combine_steps(steps: Sequence[PhaseTiming]) -> PhaseTiming:
    """One figure for a run of decode steps: the median of the per-step medians (and device
    times), the slowest first call and the largest sync count of any step."""
    syncs = [s.syncs for s in steps if s.syncs is not None]
    device = [s.device_us for s in steps if s.device_us is not None]
    return PhaseTiming(
        median_us=statistics.median(s.median_us for s in steps),
        min_us=min(s.min_us for s in steps),
        samples=sum(s.samples for s in steps),
        method=steps[0].method,
        first_call_ms=max(s.first_call_ms for s in steps),
        syncs=max(syncs) if syncs else None,
        device_us=statistics.median(device) if device else None,
    )
