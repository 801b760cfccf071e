"""Measuring one phase: first call (compile), host-device syncs, then the timed repeats.

A bench runs in rounds: every case is run once per round (cases interleaved, so host noise
falls on every case alike), each phase timed as `repeat` calls per round. `combine_rounds`
turns the rounds into one figure: the median of the round medians, the minimum over every
call, and the spread (largest round median / smallest). A spread over `UNSTABLE_SPREAD`
flags the figure as unstable.

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

from memcli.timing import Call, count_syncs, time_calls, wall_time

Fn = Callable[[], object]

# A phase whose round medians differ by more than this factor is flagged as unstable.
UNSTABLE_SPREAD = 1.20


def _noop() -> None:
    return None


@dataclass(frozen=True)
class PhaseTiming:
    """One phase: median and min of the timed calls (µs), the first call (ms), syncs per call.

    `syncs` is None on a CPU (no device to synchronise with). After `combine_rounds`,
    `median_us` is the median of `round_medians` (one per round).
    """

    median_us: float
    min_us: float
    samples: int
    method: str
    first_call_ms: float
    syncs: Optional[int]
    device_us: Optional[float] = None  # median device time (the call queued behind a busy stream)
    round_medians: tuple[float, ...] = ()

    @property
    def rounds(self) -> int:
        return max(len(self.round_medians), 1)

    @property
    def spread(self) -> float:
        """Largest round median / smallest (1.0 with a single round)."""
        if len(self.round_medians) < 2 or min(self.round_medians) <= 0:
            return 1.0
        return max(self.round_medians) / min(self.round_medians)

    @property
    def unstable(self) -> bool:
        return self.spread > UNSTABLE_SPREAD

    def to_dict(self) -> dict:
        return {"median_us": self.median_us, "min_us": self.min_us, "device_us": self.device_us,
                "samples": self.samples, "method": self.method, "first_call_ms": self.first_call_ms,
                "syncs": self.syncs, "rounds": self.rounds, "round_medians_us": list(self.round_medians),
                "spread": self.spread, "unstable": self.unstable}


def measure(fn: Fn, device: torch.device, repeat: int, warmup: int, setup: Fn = _noop,
            first_call_s: Optional[float] = None) -> PhaseTiming:
    """Time `fn` after `setup`; see the module docstring for the order of calls.

    `first_call_s`: the phase's first call was already made (and timed) by the caller.
    """
    return _measure([(fn, setup, first_call_s)], device, repeat, warmup)[0]


def measure_beside(fn: Fn, other: Optional[Fn], device: torch.device, repeat: int, warmup: int,
                   setup: Fn = _noop, first_call_s: Optional[float] = None
                   ) -> tuple[PhaseTiming, Optional[PhaseTiming]]:
    """`measure` of `fn` (after `setup`) and of `other` (which needs none), their timed calls
    taken in turn: the two figures see the same state of the machine. Without `other`, `fn`
    alone and None. `first_call_s` as in `measure`, for `fn`."""
    if other is None:
        return measure(fn, device, repeat, warmup, setup, first_call_s), None
    mine, theirs = _measure([(fn, setup, first_call_s), (other, _noop, None)], device, repeat, warmup)
    return mine, theirs


def _measure(phases: Sequence[tuple[Fn, Fn, Optional[float]]], device: torch.device, repeat: int,
             warmup: int) -> list[PhaseTiming]:
    firsts, syncs = [], []
    for fn, setup, first_call_s in phases:
        if first_call_s is None:
            setup()
            first_call_s = wall_time(fn, device)
        firsts.append(first_call_s)
        setup()
        syncs.append(count_syncs(fn, device))
    # A call that syncs waits for the spin ahead of it: its device time cannot be taken.
    calls = [Call(fn, setup, device_time=not n) for (fn, setup, _), n in zip(phases, syncs)]
    timings = time_calls(calls, device, repeat=repeat, warmup=warmup)
    return [PhaseTiming(t.median_us, t.min_us, t.samples, t.method, first * 1e3, n, t.device_us)
            for t, first, n in zip(timings, firsts, syncs)]


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


def combine_rounds(rounds: Sequence[PhaseTiming]) -> PhaseTiming:
    """One figure for a phase timed in several rounds: the median of the round medians, the
    minimum over every call, the first round's first call (the one that compiled), the
    largest sync count, and the median device time."""
    syncs = [r.syncs for r in rounds if r.syncs is not None]
    device = [r.device_us for r in rounds if r.device_us is not None]
    medians = tuple(r.median_us for r in rounds)
    return PhaseTiming(
        median_us=statistics.median(medians),
        min_us=min(r.min_us for r in rounds),
        samples=sum(r.samples for r in rounds),
        method=rounds[0].method,
        first_call_ms=rounds[0].first_call_ms,
        syncs=max(syncs) if syncs else None,
        device_us=statistics.median(device) if device else None,
        round_medians=medians,
    )
