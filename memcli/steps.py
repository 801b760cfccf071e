"""What every engine's scheduler reports and takes, whatever the engine: the step record, the
events, the counters, and the hooks a caller adds to a run. Tools read these; engines fill them.

The step log (`replay --steps-out`) and the timeline (`replay --timeline`) are built from these
alone: each `StepRecord` (with its `batch` when `SchedulerHooks.record_batches` asks for it) and
the step's `Event`s (`finish`, `abort`, `retract`, `evict`; `record_events`). An engine that
fills both gets the log and the timeline unchanged.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

from memcli.mem_cache.integrity.checker import CheckPolicy, IntegrityChecker


class Event(NamedTuple):
    step: int
    time_ms: float
    kind: str  # arrive, admit, alloc, evict, finish, retract, abort, oom
    rid: str
    tokens: int


class StepBatch(NamedTuple):
    """The requests a step computes, in batch order: `cached[i]` prefix tokens reused when
    request i was admitted in this step (0 when it was admitted earlier: a decode, a later
    chunk), `new[i]` the tokens it computes in this step (1 for a decode)."""

    rids: tuple[str, ...]
    cached: tuple[int, ...]
    new: tuple[int, ...]


NO_BATCH = StepBatch((), (), ())


class StepRecord(NamedTuple):
    step: int
    time_ms: float
    kind: str  # prefill, decode, idle
    batch_size: int
    new_tokens: int
    running: int
    waiting: int
    available: int
    evictable: int
    protected: int
    held_tokens: int
    held_pages: int
    host_used: int = 0  # hiradix: host pool slots held by the tree
    d2h_bytes: int = 0  # hiradix: bytes copied device -> host issued during the step
    h2d_bytes: int = 0  # hiradix: bytes copied host -> device issued during the step
    batch: Optional[StepBatch] = None  # the batch computed, when hooks.record_batches (else None)


class StepRun(NamedTuple):
    """The records of a run of decode steps taken at once (`SchedulerHooks.on_steps`), as
    columns: step `first + j` has `time_ms[j]`, `available[j]`, `held_tokens[j]` and
    `held_pages[j]`; every step computes the same `batch_size` requests (one token each) and
    leaves `waiting`, `evictable`, `protected` and `host_used` as they are, and copies nothing
    between device and host."""

    first: int
    time_ms: list
    batch_size: int
    waiting: int
    available: list
    evictable: int
    protected: int
    held_tokens: list
    held_pages: list
    host_used: int = 0

    def last(self) -> StepRecord:
        """The record of the run's last step."""
        j, bs = len(self.time_ms) - 1, self.batch_size
        return StepRecord(self.first + j, self.time_ms[j], "decode", bs, bs, bs, self.waiting, self.available[j],
                          self.evictable, self.protected, self.held_tokens[j], self.held_pages[j], self.host_used)


VLLM_WINDOW_REQUESTS = 1000  # CachingMetrics(max_recent_requests=1000), vLLM's logged hit rate


class VllmReported(NamedTuple):
    """vLLM's `PrefixCacheStats` summed over the run, and the hit rate its logger logs last."""

    requests: int
    queries: int
    hits: int
    preempted_requests: int
    preempted_queries: int
    preempted_hits: int
    window_requests: int
    window_queries: int
    window_hits: int

    @classmethod
    def of_steps(cls, steps: list, max_recent: int = VLLM_WINDOW_REQUESTS) -> "VllmReported | None":
        """From the per-step stats (`SchedulerStats.prefix_cache_steps`); None without any.
        The window is `CachingMetrics.observe` applied step by step: a step that admitted no
        fresh request is not observed, and while more than one step is held and they hold
        more than `max_recent` requests (1,000 in vLLM's loggers), the oldest step goes."""
        if not steps:
            return None
        totals = [sum(col) for col in zip(*steps)]
        held: deque = deque()
        n = q = h = 0
        for requests, queries, hits, *_ in steps:
            if requests == 0:
                continue
            held.append((requests, queries, hits))
            n, q, h = n + requests, q + queries, h + hits
            while len(held) > 1 and n > max_recent:
                r0, q0, h0 = held.popleft()
                n, q, h = n - r0, q - q0, h - h0
        return cls(*totals, n, q, h)

    @property
    def per_run_hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def window_hit_rate(self) -> float:
        return self.window_hits / self.window_queries if self.window_queries else 0.0

    @property
    def preempted_hit_rate(self) -> float:
        return self.preempted_hits / self.preempted_queries if self.preempted_queries else 0.0


@dataclass
class SchedulerStats:
    prefill_batches: int = 0
    decode_steps: int = 0
    idle_steps: int = 0
    allocations: int = 0
    allocated_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    retractions: int = 0
    retracted_requests: int = 0
    recomputed_tokens: int = 0
    oom_events: int = 0
    peak_request_rows: int = 0
    checks_run: int = 0
    forced_retractions: int = 0
    # Every admission (first, or again after a retraction): tokens asked (prompt and output so
    # far) and tokens matched, as vLLM's prefix-cache counters count queries and hits.
    admission_queries: int = 0
    admission_hits: int = 0
    # Per prefill batch, SGLang's logged #cached-token and #new-token (`PrefillAdder.log_*`).
    batch_cached_tokens: array = field(default_factory=lambda: array("q"))
    batch_new_tokens: array = field(default_factory=lambda: array("q"))
    # vLLM only: per step with an admission, its `PrefixCacheStats` (requests, queries, hits,
    # preempted requests, preempted queries, preempted hits), as the scheduler hands them out.
    prefix_cache_steps: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerHooks:
    """What a caller adds to a run: callbacks, checks and test switches (all optional).

    `on_step(scheduler, record)` runs after every step; `on_admission(req, admitted)` when a
    request is admitted (True: its prefill batch was built) or goes back to waiting (False:
    retracted), which memcli replay uses to move the trace's future. After each step the
    checks of `checks` run (by default sampled full walks on idle steps only), or those of a
    prebuilt `checker`. `retract_every` forces a retraction every that many decode steps;
    `page_size` gives the budget another page size than memory's (check-page-size's
    injection). `record_batches` puts the batch of every step on its record
    (`StepRecord.batch`), for the step log and the timeline. `on_steps(scheduler, run)`,
    where an engine's fast path takes a run of decode steps at once and neither events nor
    batches are recorded, receives the run's records as columns (`StepRun`) in place of an
    `on_step` per step; the scheduler's `records` then get the run's last step only."""

    output_token_base: int = 1 << 40
    record_events: bool = True
    on_step: Callable[[Any, StepRecord], None] | None = None
    on_admission: Callable[[Any, bool], None] | None = None
    checks: CheckPolicy = CheckPolicy()
    checker: IntegrityChecker | None = None
    retract_every: int = 0
    page_size: int | None = None
    record_batches: bool = False
    on_steps: Callable[[Any, "StepRun"], None] | None = None
