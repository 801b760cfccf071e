"""The one timing helper: CUDA events on a GPU, synchronized wall time on a CPU.

`time_call(fn, setup=...)` runs `setup()` (untimed) before every call, warms up, then
returns the median of the timed calls in microseconds (`time_calls` does the same for
several functions, their samples taken in turn). On a GPU each call is timed twice:

* latency: the device is idle (synchronised) when the start event is recorded, so the time
  includes the host's work and launch latency, as a scheduler waiting on the call sees it;
* device time: the call is queued behind a spin kernel that keeps the stream busy until the
  host has issued all of it, so the events see only the GPU's execution of the call (a
  sample whose spin ran out first is taken again behind a longer one).

Python's cyclic garbage collector is paused while a phase is timed (as `timeit` does): a
collection would land on whichever call happened to allocate past its threshold.

`count_syncs(fn)` counts host-device synchronisations with CUDA's sync debug mode (None on
a CPU, where there is no device).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch


@dataclass(frozen=True)
class Timing:
    median_us: float
    min_us: float
    samples: int
    method: str  # "cuda-events" or "wall-clock (cpu)"
    device_us: float | None = None  # median device time (None on a CPU)

    def to_dict(self) -> dict:
        return {"median_us": self.median_us, "min_us": self.min_us, "samples": self.samples, "method": self.method,
                "device_us": self.device_us}


def _noop() -> None:
    return None


def time_call(fn: Callable[[], object], device: torch.device, repeat: int = 20, warmup: int = 3,
              setup: Callable[[], object] = _noop, device_time: bool = True) -> Timing:
    """Median time of `fn()` over `repeat` calls, each after an untimed `setup()`.

    On a GPU also the median device time (see the module docstring) over as many calls,
    unless `device_time` is False (a call that synchronises waits for the spin ahead of it,
    so its device time cannot be taken: each try would only wait longer).
    """
    return time_calls([Call(fn, setup, device_time)], device, repeat=repeat, warmup=warmup)[0]


@dataclass(frozen=True)
class Call:
    """One function timed by `time_calls`: `setup` runs untimed before each call."""

    fn: Callable[[], object]
    setup: Callable[[], object] = _noop
    device_time: bool = True


def time_calls(calls: Sequence[Call], device: torch.device, repeat: int = 20, warmup: int = 3) -> list[Timing]:
    """`time_call` of several functions at once, their samples taken in turn (a, b, a, b,
    ...), so that every function's samples see the same spells of a noisy machine and the
    ratio of two medians holds even where the medians themselves move."""
    cuda = device.type == "cuda"
    with gc_paused():
        for _ in range(warmup):
            for call in calls:
                call.setup()
                call.fn()
        samples: list[list[float]] = [[] for _ in calls]
        for _ in range(repeat):
            for call, taken in zip(calls, samples):
                taken.append(_sample(call.fn, call.setup, device, cuda, spin_us=0.0))
        medians = [statistics.median(taken) for taken in samples]
        queued: list[list[float]] = [[] for _ in calls]
        if cuda and _spin_cycles_per_us(device) is not None:
            for _ in range(repeat):
                for call, median, taken in zip(calls, medians, queued):
                    if call.device_time:
                        # The spin outlasts the host's part of the call: twice the latency, plus a margin.
                        taken.append(_queued_sample(call.fn, call.setup, device, 2 * median + 100.0))
    method = "cuda-events" if cuda else "wall-clock (cpu)"
    return [Timing(median, min(taken), len(taken), method, statistics.median(dev) if dev else None)
            for median, taken, dev in zip(medians, samples, queued)]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (reference counting still frees as usual)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _sample(fn, setup, device: torch.device, cuda: bool, spin_us: float) -> float:
    """One timed call in microseconds; with `spin_us`, queued behind a spin of that length."""
    return _timed(fn, setup, device, cuda, spin_us)[0]


def _queued_sample(fn, setup, device: torch.device, spin_us: float, tries: int = 4) -> float:
    """One device-time sample. When the stream reached the start event before the host had
    issued the whole call (the spin ran out: a slow host, or a faster clock than calibrated),
    the sample would include host time; it is taken again behind a spin twice as long."""
    for _ in range(tries):
        elapsed_us, spin_outlasted_host = _timed(fn, setup, device, True, spin_us)
        if spin_outlasted_host:
            break
        spin_us *= 2
    return elapsed_us


def _timed(fn, setup, device: torch.device, cuda: bool, spin_us: float) -> tuple[float, bool]:
    """(µs, whether the start event was still queued when the host returned from `fn`)."""
    setup()
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6, False
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    if spin_us:
        torch.cuda._sleep(int(spin_us * _spin_cycles_per_us(device)))
    start.record()
    fn()
    still_queued = not start.query()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3, still_queued


_CYCLES_PER_US: dict[torch.device, float | None] = {}


def _spin_cycles_per_us(device: torch.device) -> float | None:
    """Spin-kernel cycles per microsecond on `device`, measured once (None without a spin kernel)."""
    if device not in _CYCLES_PER_US:
        sleep = getattr(torch.cuda, "_sleep", None)
        rate = None
        if sleep is not None:
            cycles = 2_000_000
            sleep(cycles)  # the first launch loads the kernel
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            sleep(cycles)
            end.record()
            end.synchronize()
            rate = cycles / (start.elapsed_time(end) * 1e3)
        _CYCLES_PER_US[device] = rate
    return _CYCLES_PER_US[device]


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
    return sum(1 for w in caught if is_sync_warning(str(w.message)))


def is_sync_warning(message: str) -> bool:
    """A warning of CUDA's sync debug mode about one synchronizing call, not its one-time
    notice that the mode is a prototype (which also mentions synchronization)."""
    return "synchronizing" in message and "prototype" not in message


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
