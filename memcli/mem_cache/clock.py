"""A logical clock for reproducible access times in prefix caches.

`LogicalClock()` is a zero-argument callable (a drop-in for `time.monotonic`) that returns
1.0, 2.0, 3.0, ... : it ticks by one at every read, so two reads never tie and the order
of stamps is the order of reads. Also usable where a module's `time` is expected: it has
`monotonic()`, `time()` and `perf_counter()` methods that read the same counter.
"""

from __future__ import annotations


class LogicalClock:
    """Counts reads: the n-th read returns `start + n` (a float). Not thread-safe."""

    def __init__(self, start: float = 0.0):
        self.now = float(start)  # the last value handed out

    def __call__(self) -> float:
        self.now += 1.0
        return self.now

    monotonic = time = perf_counter = __call__
