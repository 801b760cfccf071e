"""Time the radix cache against a token-by-token baseline tree.

Replays the first N prompts of a trace through `match_prefix`, `insert` (fake slot ids from
a counter) and `evict` (down to a capacity) on both implementations, with the same
simulated clock (the request index), and checks that both matched the same lengths.
Each implementation replays `repeat` times (alternating, on fresh trees); the reported
time is the median replay, counting only the tree calls (building prompts and slot ids is
outside the timer).

Tree work is host-side and single-threaded; by default the replay runs with one torch
intra-op thread, because waking a thread pool for each copy of a few hundred kilobytes
costs more than the copy on small hosts (16 ms instead of 0.2 ms for a 200k-slot
`torch.cat` on a 2-core machine). Both implementations run under the same setting.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from memcli import timing
from memcli.errors import MemcliError
from memcli.tools.bench_radix import DEFAULT_CAPACITY_TOKENS
from memcli.mem_cache.base_prefix_cache import RadixKey
from memcli.tools.bench_radix.baseline import BaselineRadixCache
from memcli.tools.bench_radix.results import BenchRadixResult
from memcli.mem_cache.radix_cache import RadixCache
from memcli.workload.readers import read_trace


Progress = Callable[[str, int, int], None]


class _CountingAllocator:
    """Stands in for the KV allocator: counts the slots the trees free."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.device = torch.device("cpu")
        self.freed = 0

    def free(self, indices: torch.Tensor) -> None:
        self.freed += len(indices)


class _RequestClock:
    """Simulated clock shared by both trees: the index of the request being replayed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_bench_radix(trace_path: str | Path, num_requests: int = 2000, page_size: int = 1,
                    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS, block_size: int = 512,
                    progress: Optional[Progress] = None, torch_threads: Optional[int] = 1,
                    repeat: int = 3) -> BenchRadixResult:
    """Replay the first `num_requests` prompts on both trees `repeat` times; return times and totals.

    `torch_threads`: intra-op threads during the replay (None keeps torch's setting);
    restored afterwards. Raises `TraceError` for a bad trace, `MemcliError` for bad sizes.
    """
    if min(page_size, capacity_tokens, num_requests, repeat) < 1:
        raise MemcliError(f"page size {page_size}, capacity {capacity_tokens}, requests {num_requests} and"
                          f" repeat {repeat} must all be >= 1",
                          hint="pass positive --page-size, --capacity, --requests and --repeat")
    trace = read_trace(trace_path, block_size=block_size, limit=num_requests)
    prompts = [spec.input_ids() for spec in trace.requests]
    radix_runs, baseline_runs = [], []
    with timing.torch_threads(torch.device("cpu"), torch_threads or None) as threads:
        for _ in range(repeat):
            radix_s, matched, radix_evicted = _replay_radix(prompts, page_size, capacity_tokens, progress)
            baseline_s, baseline_matched, baseline_evicted = _replay_baseline(prompts, page_size,
                                                                              capacity_tokens, progress)
            radix_runs.append(radix_s)
            baseline_runs.append(baseline_s)
    return BenchRadixResult(
        trace=str(trace_path), num_requests=len(prompts), page_size=page_size,
        capacity_tokens=capacity_tokens, block_size=block_size,
        prompt_tokens=sum(len(p) for p in prompts),
        matched_tokens=sum(matched), baseline_matched_tokens=sum(baseline_matched),
        mismatched_requests=sum(a != b for a, b in zip(matched, baseline_matched)),
        evicted_tokens=radix_evicted, baseline_evicted_tokens=baseline_evicted,
        radix_s=statistics.median(radix_runs), baseline_s=statistics.median(baseline_runs),
        radix_runs_s=tuple(radix_runs), baseline_runs_s=tuple(baseline_runs), torch_threads=threads,
    )


def _replay_radix(prompts, page_size, capacity_tokens, progress) -> tuple[float, list[int], int]:
    allocator, clock = _CountingAllocator(page_size), _RequestClock()
    cache = RadixCache(None, allocator, page_size, eviction_policy="lru")
    cache.clock = clock
    elapsed, matched, next_slot = 0.0, [], 1
    for i, tokens in enumerate(prompts):
        clock.now = float(i)
        values = torch.arange(next_slot, next_slot + len(tokens), dtype=torch.int64)
        next_slot += len(tokens)
        start = time.perf_counter()
        key = RadixKey(tokens)
        matched.append(len(cache.match_prefix(key).device_indices))
        cache.insert(key, values)
        excess = cache.evictable_size() + cache.protected_size() - capacity_tokens
        if excess > 0:
            cache.evict(excess)
        cache.eviction_log.clear()
        elapsed += time.perf_counter() - start
        _report(progress, "radix", i + 1, len(prompts))
    return elapsed, matched, allocator.freed


def _replay_baseline(prompts, page_size, capacity_tokens, progress) -> tuple[float, list[int], int]:
    allocator, clock = _CountingAllocator(page_size), _RequestClock()
    cache = BaselineRadixCache(allocator, page_size, clock=clock)
    elapsed, matched, next_slot = 0.0, [], 1
    for i, array in enumerate(prompts):
        clock.now = float(i)
        tokens = array.tolist()  # the baseline's native key type, built outside the timer
        values = torch.arange(next_slot, next_slot + len(tokens), dtype=torch.int64)
        next_slot += len(tokens)
        start = time.perf_counter()
        matched.append(len(cache.match_prefix(tokens)[0]))
        cache.insert(tokens, values)
        excess = cache.evictable_size() + cache.protected_size() - capacity_tokens
        if excess > 0:
            cache.evict(excess)
        elapsed += time.perf_counter() - start
        _report(progress, "baseline", i + 1, len(prompts))
    return elapsed, matched, allocator.freed


def _report(progress: Optional[Progress], name: str, done: int, total: int) -> None:
    if progress is not None and (done % 500 == 0 or done == total):
        progress(name, done, total)
