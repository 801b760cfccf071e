"""The result of one replay: frozen sections, each rendered by `memcli.tools.replay.report`, and
the outcome of the command (`ReplayOutcome`: the replay, its bound, the files written)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from memcli.capacity import LimitCuts
from memcli.config import Config
from memcli.tools.replay.host_tier import HostTierStats
from memcli.tools.replay.metrics import EvictionStats, OccupancyStats, PrefixStats, QueueStats
from memcli.tools.replay.requests import DelayStats, RequestLog
from memcli.tools.replay.step_times import StepTimes


@dataclass(frozen=True)
class TraceInfo:
    path: str
    format: str
    block_size: int
    requests: int
    input_tokens: int
    output_tokens: int
    has_timestamps: bool
    ignored_fields: tuple[str, ...]


@dataclass(frozen=True)
class RunSummary:
    """Counts of the run itself. `output_tokens` are the tokens generated (a request asking for
    0 still produces the one token of its prefill)."""

    requests: int
    finished: int
    aborted: int
    output_tokens: int
    simulated_ms: float
    steps: int
    prefill_steps: int
    decode_steps: int
    idle_steps: int
    wall_s: float

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class AllocationStats:
    """Allocator traffic: one allocation per prefill batch or decode step; a free is one call
    that returned pages (`freed_tokens` counts whole pages, in tokens)."""

    allocations: int
    allocated_tokens: int
    frees: int
    freed_tokens: int
    peak_request_rows: int
    request_rows: int
    oom_events: int


@dataclass(frozen=True)
class SchedulingStats:
    retractions: int
    retracted_requests: int
    recomputed_tokens: int
    aborted: int
    queue: QueueStats


@dataclass(frozen=True)
class IntegrityStats:
    """`mode`: "every step" (--check: incremental), "every step (full)" (--check full) or "idle
    steps and end". `failure` is the first violation's message (the replay stopped there), with
    the step (0-based) and the check that found it when known. `end_*`: the pool when the
    replay ended. `full_walks`: whole-pool walks (sampled on idle steps, every step under
    --check full, and the final one); `check_s`: wall time spent checking. `history`: under
    --check (the ownership ledger), every operation that touched the pages the failure names."""

    mode: str
    checks_run: int
    failure: Optional[str]
    final_reports: tuple[dict, ...]
    end_available: int
    end_evictable: int
    end_protected: int
    end_rows_in_use: int
    pool_tokens: int
    full_walks: int = 0
    incremental_checks: int = 0
    check_s: float = 0.0
    failure_step: Optional[int] = None
    failure_check: Optional[str] = None
    history: tuple = ()  # the failure's story: the touches (`integrity.Touch`) of its pages, oldest first

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def everything_free(self) -> bool:
        """No request holds memory: every slot is free or evictable, every row free."""
        return (self.end_protected == 0 and self.end_rows_in_use == 0
                and self.end_available + self.end_evictable == self.pool_tokens)


@dataclass(frozen=True)
class Stop:
    """Why a replay ended before its trace did: `interrupted` (Ctrl-C) or `stalled` (the
    scheduler's progress guard). `message` is the one line the CLI prints."""

    reason: str
    message: str


@dataclass(frozen=True)
class ReplayResult:
    trace: TraceInfo
    arrivals: str
    config: Config
    device: str
    kernel_backend: str
    summary: RunSummary
    prefix: PrefixStats
    occupancy: OccupancyStats
    allocation: AllocationStats
    eviction: EvictionStats
    scheduling: SchedulingStats
    integrity: IntegrityStats
    series: dict[str, np.ndarray]
    first_cached_tokens: np.ndarray
    """Per request in trace order: tokens matched at first admission, -1 if never admitted."""
    stop: Optional[Stop] = None
    """Set when the replay stopped early; the rest of the result covers the replay so far."""
    requests_log: Optional[RequestLog] = None
    """Per request: arrival, admission, finish, tokens, retractions (`replay --requests-out`)."""
    queueing_delay: Optional[DelayStats] = None
    host_tier: Optional[HostTierStats] = None
    """The host tier's tiers, transfers and occupancy (`cache.kind: hiradix` only)."""
    limits: LimitCuts = LimitCuts()
    """The requests the engine's limits cut: aborted at arrival, or outputs clipped."""
    step_times: Optional[StepTimes] = None
    """Wall time per kind of step, when `ReplayOptions.step_times` asked for it."""

    @property
    def interrupted(self) -> bool:
        return self.stop is not None and self.stop.reason == "interrupted"


@dataclass(frozen=True)
class ReplayOutcome:
    """What `memcli replay TRACE` did: the replay, the Belady replay of `--bound belady`
    (None without it, or when the replay stopped early), the config keys it ignored, the
    rows written to `requests_out` (None: no file asked for) and the plot written (None:
    none asked for, or the replay stopped early)."""

    result: ReplayResult
    bound: Optional[ReplayResult]
    ignored_keys: tuple[str, ...]
    requests_out: Optional[Path] = None
    requests_written: Optional[int] = None
    plot: Optional[Path] = None

    @property
    def failed(self) -> bool:
        """An integrity check failed, or the replay stopped before the trace ended."""
        return not self.result.integrity.ok or self.result.stop is not None
