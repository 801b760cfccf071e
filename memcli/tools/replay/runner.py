"""Replay a trace through the full memory stack and the scheduler's simulated forward step.

Arrivals (`ReplayOptions.arrivals`):

- `timestamp`: each request arrives at its trace time on the simulated clock, which advances
  by the cost model of `config.sim` (see `memcli.config.SimConfig`).
- `burst`: every request arrives at t = 0.
- `sequential`: one request at a time; the next is added only when the scheduler is done with
  the previous one (match, prefill, every decode step, finish).

Requests are handed to the scheduler only when they arrive, and dropped once finished, so a
145 M-token trace never holds more than the running and waiting prompts in memory. Nothing
starts before every request is known to fit, or to be cut by the engine's limits as the engine
cuts it (`memcli.capacity.cut_requests`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from memcli.capacity import LimitCuts, cut_requests
from memcli.config import Config, replace
from memcli.errors import IntegrityError, MemcliError, StalledError
from memcli.mem_cache.integrity import CheckPolicy
from memcli.mem_cache.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, VllmAllBlocksCleared,
                                       VllmBlockRemoved, VllmBlockStored)
from memcli.tools.replay import ARRIVALS
from memcli.tools.replay.ceiling import shared_prefix_lens
from memcli.tools.replay.requests import RequestLog, delay_stats
from memcli.tools.replay.host_tier import TierLog, host_tier_stats
from memcli.tools.replay.instruments import Instruments, opened
from memcli.tools.replay.metrics import (EngineCounters, EvictionLog, StepSeries, eviction_stats, occupancy_stats, prefix_stats,
                                   queue_stats)
from memcli.tools.replay.results import (AllocationStats, IntegrityStats, ReplayResult, RunSummary, SchedulingStats,
                                  Stop, TraceInfo)
from memcli.tools.replay.step_times import StepTimes, timed_step
from memcli import engines
from memcli.devices import resolve_device
from memcli.steps import SchedulerHooks
from memcli.timing import torch_threads
from memcli.workload.chains import SharedPrefixChains
from memcli.workload.future import FutureTooLarge, FutureUses, build_future, check_future_fits
from memcli.workload.spec import Trace, apply_sampling, output_token_base

RECORDS_KEPT = 4096  # the scheduler's own step records are trimmed to this many (we keep our own)
MAX_RUN_STEPS = 1024  # the longest run of steady decode steps taken at once
# The cyclic collector's youngest generation is collected after this many new container
# objects while a replay runs (Python's default is 700). A replay's objects are mostly
# acyclic (an evicted node is unlinked from its parent): the whole conversation trace's replay
# spends 0.19 s in the collector at the default and 0.02 s here, at the same peak memory
# (docs/PERFORMANCE.md, fourteenth round).
GC_YOUNG_THRESHOLD = 10_000


@dataclass(frozen=True)
class ReplayOptions:
    """How to replay. `events_path`: write the KV events stream there (JSON lines).

    `check_every_step`: check after every step, incrementally (`check_level="incremental"`:
    the ownership ledger, O(what the step changed)) or by the full walk (`"full"`: O(pool)).
    Idle steps walk the whole pool at most once per `walk_every` idle steps, within
    `walk_budget` of the wall time (`memcli.mem_cache.integrity.CheckPolicy`)."""

    arrivals: str = "timestamp"
    check_every_step: bool = False
    events_path: Optional[Path] = None
    check_level: str = "incremental"
    walk_every: int = CheckPolicy.walk_every
    walk_budget: float = CheckPolicy.walk_budget
    steps_path: Optional[Path] = None  # --steps-out: the step log (JSON lines)
    timeline_path: Optional[Path] = None  # --timeline: the Chrome trace-event timeline
    strict_limits: bool = False  # refuse a trace with a request past the engine's limits (else cut as it does)
    step_times: bool = False  # time every step, by kind (`ReplayResult.step_times`; the replay bench)
    plain_loop: bool = False  # every step through the plain loop (no decode runs taken at once)

    @property
    def instrumented(self) -> bool:
        return self.steps_path is not None or self.timeline_path is not None

    @property
    def check_policy(self) -> CheckPolicy:
        return CheckPolicy(self.check_level if self.check_every_step else "none", self.walk_every, self.walk_budget)


@dataclass(frozen=True)
class Progress:
    """Handed to the progress callback: requests finished so far and where the clock is."""

    finished: int
    total: int
    steps: int
    simulated_ms: float


ProgressFn = Callable[[Progress], None]


def default_arrivals(trace: Trace) -> str:
    """`timestamp` for traces with arrival times, `burst` for traces without."""
    return "timestamp" if trace.has_timestamps else "burst"


def check_options(trace: Trace, config: Config, options: ReplayOptions) -> None:
    """Raise `MemcliError` for options that cannot apply to this trace or config."""
    if options.arrivals not in ARRIVALS:
        raise MemcliError(f'unknown arrivals mode "{options.arrivals}"', f"use one of: {', '.join(ARRIVALS)}")
    if options.arrivals == "timestamp" and not trace.has_timestamps:
        raise MemcliError(f"{trace.path}: --arrivals timestamp needs arrival times, and this trace has none",
                          "use --arrivals burst or --arrivals sequential")
    if options.events_path is not None and config.cache.kind != "radix":
        raise MemcliError(f"--events needs the radix cache, but cache.kind is {config.cache.kind}",
                          "use --set cache.kind=radix")
    if config.cache.eviction_policy == "belady":
        if config.cache.kind == "hiradix":
            raise MemcliError("cache.eviction_policy belady ranks the leaves of the radix cache; the host tier"
                              " (cache.kind hiradix) is not modelled with it", "use --set cache.kind=radix with belady,"
                              " or lru, lfu or fifo with hiradix")
        if config.cache.kind == "radix":
            check_future_fits(trace, config.page_size)


def replay(config: Config, trace: Trace, options: ReplayOptions, progress: Optional[ProgressFn] = None,
           shared: Optional[np.ndarray] = None, kept: Optional[dict] = None) -> ReplayResult:
    """Replay `trace`; returns the result, also when an integrity check failed (then
    `result.integrity.failure` says what, and the result covers the replay so far).

    Raises `MemcliError` / `CapacityError` before anything runs when the options or a request
    cannot work. `shared` is the ceiling of the trace (`shared_prefix_lens`), computed when None.
    `kept`: the read-only indexes of `trace` kept between replays of it (`build_future`).
    """
    check_options(trace, config, options)
    cuts = limit_cuts(config, trace, options)
    if options.events_path is not None and not config.cache.kv_events:
        config = replace(config, cache={"kv_events": True})
    if shared is None:
        shared = shared_prefix_lens(trace)
    with _events_file(options.events_path) as events, opened(options.steps_path, options.timeline_path) as files:
        run = _Run(config, trace, options, events, progress, files, kept)
        return dataclasses.replace(run.execute(shared), limits=cuts)


def limit_cuts(config: Config, trace: Trace, options: ReplayOptions) -> LimitCuts:
    """The requests the engine's limits cut (aborted at arrival, outputs clipped), as it does
    serving them; under `options.strict_limits` none, and a request past them is a
    `CapacityError`, as is one that cannot run even so."""
    return cut_requests(config, trace.requests, trace.path, engines.get(config).limits, options.strict_limits)


@contextlib.contextmanager
def _events_file(path: Optional[Path]):
    if path is None:
        yield None
        return
    try:
        fh = open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise MemcliError(f"cannot write {path}: {exc.strerror}", "check that the folder exists and is writable") from None
    with fh:
        yield fh


@contextlib.contextmanager
def _fewer_collections():
    """The collector's youngest generation at `GC_YOUNG_THRESHOLD` (if that is higher), restored after."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], GC_YOUNG_THRESHOLD), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


class _Run:
    """One replay in progress: the stack, the scheduler, and what is collected per step."""

    def __init__(self, config: Config, trace: Trace, options: ReplayOptions, events, progress, files=(None, None),
                 kept: Optional[dict] = None):
        self.config, self.trace, self.options, self.kept = config, trace, options, kept
        self.events, self.progress = events, progress
        self.index = {spec.rid: i for i, spec in enumerate(trace.requests)}
        timed = options.arrivals == "timestamp"
        self.log = RequestLog(trace.num_requests, np.fromiter(
            (spec.arrival_ms if timed else np.nan for spec in trace.requests), dtype=np.float64,
            count=trace.num_requests))
        self.tiers = TierLog(trace.num_requests) if config.cache.kind == "hiradix" else None
        self.future: Optional[FutureUses] = None
        self.future_missing = ""  # why the replay has no future (the eviction report says it)
        self.next = 0
        self.output_tokens = 0
        self.series = StepSeries()
        self.evictions = EvictionLog()
        self._progress_at = 0.0
        self.stop: Optional[Stop] = None
        self.failure_at: tuple[Optional[int], Optional[str]] = (None, None)
        self.history: tuple = ()  # the failure's page history (`OwnershipError.history`)
        self.files = files
        self.instruments: Optional[Instruments] = None
        self.step_times = StepTimes() if options.step_times else None

    def execute(self, shared: np.ndarray) -> ReplayResult:
        start = time.perf_counter()
        with torch_threads(resolve_device(self.config)), _fewer_collections():
            engine = engines.get(self.config)
            self.future, self.future_missing = self._build_future(engine)
            self.stack = engine.build_stack(self.config, future=self.future)
            self.memory = self.stack.memory
            share = getattr(self.memory, "share_prompt_hashes", None)  # a memory that hashes prompts (vLLM's)
            if share is not None and self.trace.format == "mooncake":
                share(lambda block_size: SharedPrefixChains(self.trace, block_size))
            instrumented = self.options.instrumented
            if instrumented:
                self.instruments = Instruments(*self.files, self.memory.size, self.memory.host_tier() is not None)
            self.scheduler = engine.scheduler(self.memory, self.config, SchedulerHooks(
                output_token_base=output_token_base(self.trace), record_events=instrumented, on_step=self._on_step,
                on_steps=self._on_steps,
                checks=self.options.check_policy,
                on_admission=None if self.future is None else self._on_admission, record_batches=instrumented,
            ))
            failure, reports = self._loop()
            if self.instruments is not None:
                self.instruments.close()
        wall_s = time.perf_counter() - start
        return self._result(shared, failure, reports, wall_s)

    def _build_future(self, engine: engines.Engine) -> tuple[Optional[FutureUses], str]:
        """The trace's future uses, for an engine's radix cache (`Engine.tracks_uses`): Belady
        reads it, and every replay's eviction stats (reuse distance); with None, why there is
        none. Without belady a trace too large for it goes without."""
        if not engine.tracks_uses:
            return None, f"{engine.name}'s evictions do not name the requests that use what they evict"
        if self.config.cache.kind != "radix":
            return None, f"cache.kind {self.config.cache.kind}'s evictions do not name the requests that use them"
        try:
            return build_future(self.trace, self.config.page_size, self.kept), ""
        except FutureTooLarge:
            if self.config.cache.eviction_policy == "belady":
                raise
            return None, "the trace is too large for its future index"

    def _on_admission(self, req, admitted: bool) -> None:
        self.future.set_admitted(self.index[req.rid], admitted)

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> tuple[Optional[str], tuple[dict, ...]]:
        sched = self.scheduler
        if self.options.arrivals == "burst":
            while self.next < self.trace.num_requests:
                self._add(0.0)
        times, start = self.step_times, time.perf_counter()
        runs = None if self.options.plain_loop else getattr(sched, "decode_runs", None)
        try:
            while True:
                self._feed()
                if sched.is_done():
                    break
                steps = 0 if runs is None else runs.steady(MAX_RUN_STEPS)
                if steps:
                    self._take_run(runs, steps)
                elif times is None:
                    sched.step()
                else:
                    timed_step(sched.step, times, sched.finished)
                self._after_step()
            if times is not None:
                times.close(time.perf_counter() - start)
            self.memory.finish_copies()  # the host tier's last copies are waited for
            reports = self.memory.check(sched.memory_holders())
        except IntegrityError as exc:
            self.failure_at = (getattr(exc, "step", None), getattr(exc, "check", None))
            self.history = tuple(getattr(exc, "history", ()))
            self._stopped_mid_step()
            return getattr(exc, "message", str(exc)), ()
        except StalledError as exc:
            self._stopped_mid_step()
            self.stop = Stop("stalled", str(exc))
            return None, ()
        except KeyboardInterrupt:
            self._stopped_mid_step()
            done = sched.stats.finished + sched.stats.aborted
            total = self.trace.num_requests
            self.stop = Stop("interrupted", f"interrupted at request {min(done + 1, total)} of {total},"
                                            f" step {sched.step_count} (simulated {sched.clock_ms / 1e3:,.1f} s)")
            return None, ()
        self._report_progress(force=True)
        return None, tuple(report.to_dict() for report in reports)

    def _take_run(self, runs, steps: int) -> None:
        """A run of steady decode steps (`memcli.sched.decode_run`), up to the next arrival."""
        requests, timed = self.trace.requests, self.options.arrivals == "timestamp"
        until_ms = requests[self.next].arrival_ms if timed and self.next < self.trace.num_requests else math.inf
        if self.step_times is None:
            runs.take(steps, until_ms)
            return
        start = time.perf_counter()
        taken = runs.take(steps, until_ms)
        self.step_times.add_run("decode", taken, time.perf_counter() - start)

    def _stopped_mid_step(self) -> None:
        sched = self.scheduler
        if sched.records and len(self.series) < sched.step_count:
            self.series.append(sched.records[-1])  # the failing step's record (on_step never saw it)
        self._harvest_unfinished()
        self._after_step()

    def _feed(self) -> None:
        """Hand the scheduler what has arrived; when it is idle, the next request (the
        scheduler's idle step then moves the clock to its arrival)."""
        sched, requests, n = self.scheduler, self.trace.requests, self.trace.num_requests
        mode = self.options.arrivals
        if mode == "timestamp":
            while self.next < n and requests[self.next].arrival_ms <= sched.clock_ms:
                self._add(requests[self.next].arrival_ms)
            if self.next < n and sched.is_done():
                self._add(requests[self.next].arrival_ms)
        elif mode == "sequential" and self.next < n and sched.is_done():
            self._add(sched.clock_ms)

    def _add(self, arrival_ms: float) -> None:
        spec = self.trace.requests[self.next]
        sched = self.scheduler
        # A priority only when the trace gives one: an engine without vLLM's priority policy may not take it.
        extra = {"priority": spec.priority} if spec.priority else {}
        ids = spec.input_ids(room=spec.output_len)  # with room for the outputs: the request's token buffer
        req = sched.new_req(spec.rid, ids, spec.output_len, spec.extra_key, arrival_ms, **extra)
        apply_sampling(req, spec)
        sched.add_request(req)
        if self.instruments is not None:
            self.instruments.arrived(spec.rid, arrival_ms)
        self.next += 1

    def _on_step(self, scheduler: engines.Scheduler, record) -> None:
        self.series.append(record)
        if self.instruments is not None:
            self.instruments.step(record, scheduler.events)
            scheduler.events.clear()

    def _on_steps(self, scheduler: engines.Scheduler, run) -> None:
        self.series.extend(run)

    def _after_step(self) -> None:
        sched = self.scheduler
        if sched.finished:
            for req in sched.finished:
                self._harvest(req)
                self.output_tokens += len(req.output_ids)
            sched.finished.clear()
        if len(sched.records) > RECORDS_KEPT:
            sched.records.clear()
        self.evictions.drain(self.memory.take_evictions())
        if self.events is not None:
            _write_events(self.events, self.memory.take_events(), sched.step_count, sched.clock_ms)
        if self.progress is not None:
            self._report_progress()

    def _harvest(self, req) -> None:
        index = self.index[req.rid]
        self.log.record(index, req)
        if self.tiers is not None and req.first_cached_tokens is not None:
            self.tiers.harvest(index, req)

    def _harvest_unfinished(self) -> None:
        """After a stop: the hits of requests admitted but not finished count too."""
        sched = self.scheduler
        for req in [*sched.active_reqs(), *sched.waiting]:
            self._harvest(req)

    def _report_progress(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.progress is None or (not force and now - self._progress_at < 0.2):
            return
        self._progress_at = now
        sched = self.scheduler
        done = sched.stats.finished + sched.stats.aborted  # aborts while waiting never reach `finished`
        self.progress(Progress(done, self.trace.num_requests, sched.step_count, sched.clock_ms))

    # -- the result ----------------------------------------------------------------------
    def _result(self, shared: np.ndarray, failure: Optional[str], reports: tuple[dict, ...],
                wall_s: float) -> ReplayResult:
        config, trace, sched, stats = self.config, self.trace, self.scheduler, self.scheduler.stats
        ps, pool = config.page_size, self.memory.size
        series = self.series.arrays(pool, ps)
        input_lens = np.fromiter((r.input_len for r in trace.requests), dtype=np.int64, count=trace.num_requests)
        memory = self.memory
        frees, freed_tokens = memory.allocator_totals()
        end = memory.usage()
        return ReplayResult(
            trace=TraceInfo(str(trace.path), trace.format, trace.block_size, trace.num_requests,
                            trace.input_tokens, trace.output_tokens, trace.has_timestamps, trace.ignored_fields),
            arrivals=self.options.arrivals,
            config=config,
            device=str(self.stack.device),
            kernel_backend=self.stack.backend,
            summary=RunSummary(
                requests=trace.num_requests, finished=stats.finished, aborted=stats.aborted,
                output_tokens=self.output_tokens, simulated_ms=sched.clock_ms, steps=sched.step_count,
                prefill_steps=stats.prefill_batches, decode_steps=stats.decode_steps, idle_steps=stats.idle_steps,
                wall_s=wall_s,
            ),
            prefix=prefix_stats(input_lens, self.log.cached_tokens, shared, ps, trace.block_size, EngineCounters(
                np.frombuffer(stats.batch_cached_tokens, dtype=np.int64),
                np.frombuffer(stats.batch_new_tokens, dtype=np.int64), stats.admission_queries, stats.admission_hits,
                tuple(stats.prefix_cache_steps))),
            occupancy=occupancy_stats(series, pool, ps),
            allocation=AllocationStats(
                allocations=stats.allocations, allocated_tokens=stats.allocated_tokens, frees=frees,
                freed_tokens=freed_tokens, peak_request_rows=stats.peak_request_rows,
                request_rows=memory.max_running, oom_events=stats.oom_events,
            ),
            eviction=eviction_stats(self.evictions, config.cache.eviction_policy, self.log.admission_ms,
                                    self.future is not None, self.future_missing),
            scheduling=SchedulingStats(stats.retractions, stats.retracted_requests, stats.recomputed_tokens,
                                       stats.aborted, queue_stats(series)),
            integrity=IntegrityStats(
                mode=_mode(self.options),
                checks_run=stats.checks_run + (failure is None), failure=failure, final_reports=reports,
                end_available=end.available, end_evictable=end.evictable,
                end_protected=end.protected, end_rows_in_use=memory.rows_in_use(),
                pool_tokens=pool, full_walks=sched.checker.stats.full_walks + (failure is None),
                incremental_checks=sched.checker.stats.incremental,
                check_s=sched.checker.stats.incremental_s + sched.checker.stats.walk_s,
                failure_step=self.failure_at[0], failure_check=self.failure_at[1], history=self.history,
            ),
            series=series,
            first_cached_tokens=self.log.cached_tokens,
            requests_log=self.log,
            queueing_delay=delay_stats(self.log),
            stop=self.stop,
            host_tier=None if self.tiers is None else host_tier_stats(self.tiers, self.log.cached_tokens, input_lens,
                                                                       series, memory.host_tier()),
            step_times=self.step_times,
        )


def _mode(options: ReplayOptions) -> str:
    if not options.check_every_step:
        return "idle steps and end"
    return "every step" if options.check_level == "incremental" else f"every step ({options.check_level})"


def _write_events(fh, events: list, step: int, time_ms: float) -> None:
    for event in events:
        fh.write(json.dumps(_event_dict(event, step, time_ms), separators=(",", ":")) + "\n")


def _event_dict(event, step: int, time_ms: float) -> dict:
    head = {"step": step, "time_ms": round(time_ms, 3)}
    if isinstance(event, BlockStored):
        return {"type": "stored", **head, "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "extra_key": event.extra_key}
    if isinstance(event, BlockRemoved):
        return {"type": "removed", **head, "block_hashes": list(event.block_hashes)}
    if isinstance(event, AllBlocksCleared):
        return {"type": "cleared", **head}
    if isinstance(event, VllmBlockStored):  # vLLM's wire shape: the tag is the class name
        return {"type": "BlockStored", **head, "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": None, "medium": event.medium, "lora_name": None,
                "extra_keys": None if event.extra_keys is None else [None if k is None else list(k) for k in event.extra_keys]}
    if isinstance(event, VllmBlockRemoved):
        return {"type": "BlockRemoved", **head, "block_hashes": list(event.block_hashes), "medium": event.medium}
    if isinstance(event, VllmAllBlocksCleared):
        return {"type": "AllBlocksCleared", **head}
    raise TypeError(f"unknown KV event {event!r}")
