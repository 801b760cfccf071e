"""The one timing helper: CUDA events on a GPU, synchronized wall time on a CPU.

`time_call(fn, setup=...)` runs `setup()` (untimed) before every call, warms up, then
returns the median of the timed calls in microseconds. `count_syncs(fn)` counts host-device
synchronisations with CUDA's sync debug mode (None on a CPU, where there is no device).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import torch


@dataclass(frozen=True)
class Timing:
    median_us: float
    min_us: float
    samples: int
    method: str  # "cuda-events" or "wall-clock (cpu)"

    def to_dict(self) -> dict:
        return {"median_us": self.median_us, "min_us": self.min_us, "samples": self.samples, "method": self.method}


def _noop() -> None:
    return None


def time_call(fn: Callable[[], object], device: torch.device, repeat: int = 20, warmup: int = 3,
              setup: Callable[[], object] = _noop) -> Timing:
    """Median time of `fn()` over `repeat` calls, each after an untimed `setup()`."""
    for _ in range(warmup):
        setup()
        fn()
    samples = []
    cuda = device.type == "cuda"
    for _ in range(repeat):
        setup()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    method = "cuda-events" if cuda else "wall-clock (cpu)"
    return Timing(statistics.median(samples), min(samples), len(samples), method)


def count_syncs(fn: Callable[[], object], device: torch.device) -> int | None:
    """Host-device synchronisations made by one call of `fn` (None without CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum(1 for w in caught if "synchroniz" in str(w.message))


def wall_time(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one synchronized call (for compile times and whole runs)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


@contextlib.contextmanager
def torch_threads(device: torch.device, threads: int | None = 1) -> Iterator[int]:
    """Run torch with `threads` intra-op threads on a CPU (None: leave it), restoring after.

    The memory path issues many small tensor operations; on a small host waking a thread
    pool for each costs more than the work (a gather of 8k indices: 6 ms with two threads,
    0.1 ms with one, on a 2-core machine). On a GPU nothing changes.
    """
    before = torch.get_num_threads()
    if device.type != "cpu" or threads is None:
        yield before
        return
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)
