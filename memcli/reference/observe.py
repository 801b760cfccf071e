"""Step observations of both schedulers, and the side-by-side run that compares them.

`StepObservation` is what one scheduler step did, in the same terms on both sides:
`observe_reference(loop)` reads it from a `ReferenceLoop` after `loop.step()`, and
`MemcliSide.step()` runs one step of memcli's `Scheduler` and reads it there.
`run_side_by_side` steps both until the first step whose observations differ.

memcli's scheduler is observed without changing it: `MemcliSide` wraps, on the instance,
the two cost-model methods (`prefill_cost_ms`, `decode_cost_ms`, each called once per
batch that runs, after its allocation and before its results are processed) to see the
batch, and the tree cache's `evict` to count evicted tokens; finished and retracted
requests come from the scheduler's own event log.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from memcli.config import Config
from memcli.reference.failure import RAISED, debugging, raised_at, what_raised
from memcli.reference.loop import ReferenceLoop
from memcli.reference.loop_overlap import reference_loop
from memcli.sched.scheduler import Scheduler, SchedulerHooks
from memcli.stack import build_stack
from memcli.workload.spec import RequestSpec, apply_sampling

COMPARED = ("kind", "rids", "extend_lens", "prefix_lens", "out_cache_loc", "evicted", "retracted", "finished",
            "available", "evictable", "protected", "host_used")


@dataclass(frozen=True)
class StepObservation:
    """One scheduler step. Compared fields are `COMPARED`; the rest is context for reports.

    `rids`, `extend_lens`, `prefix_lens` are in batch order; `prefix_lens` is each request's
    cached prefix at this admission (a chunk's prefix includes its earlier chunks);
    `extend_lens` is empty for decode. `out_cache_loc` lists the slots written this step.
    `evicted` is tokens the tree evicted during the step; sizes are in tokens after it;
    `host_used` is the host tier's used slots (0 without one).
    """

    step: int
    kind: str  # prefill, decode, idle
    rids: tuple[str, ...]
    extend_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    out_cache_loc: tuple[int, ...]
    evicted: int
    retracted: tuple[str, ...]
    finished: tuple[str, ...]
    available: int
    evictable: int
    protected: int
    clock_ms: float = field(default=0.0, compare=False)
    waiting: tuple[str, ...] = field(default=(), compare=False)
    running: tuple[str, ...] = field(default=(), compare=False)
    chunked: Optional[str] = field(default=None, compare=False)
    new_token_ratio: float = field(default=0.0, compare=False)
    host_used: int = 0

    def differing(self, other: "StepObservation") -> list[str]:
        """Names of the compared fields whose values differ."""
        return [name for name in COMPARED if getattr(self, name) != getattr(other, name)]

    def lines(self) -> list[str]:
        def short(values: tuple) -> str:
            text = list(values)
            return f"{text[:12]}{' ...' if len(text) > 12 else ''} ({len(text)})" if len(text) > 12 else str(text)
        return [f"kind={self.kind} rids={short(self.rids)}",
                f"extend_lens={short(self.extend_lens)} prefix_lens={short(self.prefix_lens)}",
                f"out_cache_loc={short(self.out_cache_loc)}",
                f"evicted={self.evicted} retracted={list(self.retracted)} finished={list(self.finished)}",
                f"available={self.available} evictable={self.evictable} protected={self.protected}"
                f" host_used={self.host_used}",
                f"clock_ms={self.clock_ms:.3f} new_token_ratio={self.new_token_ratio:.4f} chunked={self.chunked}",
                f"running={short(self.running)} waiting={short(self.waiting)}"]


class _Batch(NamedTuple):
    rids: tuple[str, ...]
    extend_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    out_cache_loc: tuple[int, ...]


_NO_BATCH = _Batch((), (), (), ())


def _ints(values: Any) -> tuple[int, ...]:
    if values is None:
        return ()
    return tuple(int(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values))


def observe_reference(loop: ReferenceLoop) -> StepObservation:
    """What the step just taken by `loop` did (call right after `loop.step()`)."""
    batch = loop.step_batch if loop.step_kind != "idle" else None
    if batch is None:
        seen = _NO_BATCH
    elif loop.step_kind == "prefill":
        seen = _Batch(tuple(r.rid for r in batch.reqs), _ints(batch.extend_lens), _ints(batch.prefix_lens),
                      _ints(batch.out_cache_loc))
    else:
        seen = _Batch(tuple(r.rid for r in batch.reqs), (), (), _ints(batch.out_cache_loc))
    available, evictable, protected = loop.sizes()
    chunked = loop.chunked_req.rid if loop.chunked_req is not None else None
    return StepObservation(loop.step_count - 1, loop.step_kind, *seen, loop.step_evicted, tuple(loop.step_retracted),
                           tuple(loop.step_finished), available, evictable, protected, loop.clock_ms,
                           tuple(loop.waiting_rids()), tuple(loop.running_rids()), chunked, loop.new_token_ratio,
                           loop.host_used())


class MemcliSide:
    """memcli's stack and `Scheduler` over the same requests, observed step by step."""

    def __init__(self, config: Config, requests: Sequence[RequestSpec], arrivals: str, output_token_base: int,
                 plain_loop: bool = False):
        self.plain_loop = plain_loop  # `steps` never takes a run of decode steps at once
        # The request rows of each step of the run `steps` took last (None: it took one step).
        self.run_rows: Optional[list[tuple[int, ...]]] = None
        self.stack = build_stack(config)
        if self.stack.host_pool is not None:
            # SGLang's side runs a synchronous cache controller: copies take no time there, nor here.
            controller = self.stack.tree_cache.controller
            controller.bandwidth_gbps, controller.latency_us = math.inf, 0.0
        self.scheduler = sched = Scheduler(self.stack.memory, config,
                                           SchedulerHooks(output_token_base=output_token_base, record_events=True))
        for spec in requests:
            arrival_ms = 0.0 if arrivals == "burst" else float(spec.arrival_ms or 0.0)
            req = sched.new_req(spec.rid, spec.input_ids(), spec.output_len, spec.extra_key, arrival_ms)
            apply_sampling(req, spec)
            sched.add_request(req)
        self._batch = _NO_BATCH
        self._evicted = 0
        self._wrap_cost(sched, "prefill_cost_ms", prefill=True)
        self._wrap_cost(sched, "decode_cost_ms", prefill=False)
        tree = self.stack.tree_cache
        real_evict = tree.evict

        def evict(num_tokens: int, *args, **kwargs):
            before = tree.evictable_size()
            result = real_evict(num_tokens, *args, **kwargs)
            self._evicted += before - tree.evictable_size()
            return result

        tree.evict = evict

    def _wrap_cost(self, sched: Scheduler, name: str, prefill: bool) -> None:
        real = getattr(sched, name)

        def cost(batch):
            rids = tuple(r.rid for r in batch.reqs)
            if prefill:
                self._batch = _Batch(rids, _ints(batch.extend_plan.extend_lens_cpu), _ints(batch.prefix_lens_cpu),
                                     _ints(batch.out_cache_loc))
            else:
                self._batch = _Batch(rids, (), (), _ints(batch.out_cache_loc))
            return real(batch)

        setattr(sched, name, cost)

    def is_done(self) -> bool:
        return self.scheduler.is_done()

    def step(self) -> StepObservation:
        sched = self.scheduler
        self._batch, self._evicted = _NO_BATCH, 0
        first_event = len(sched.events)
        record = sched.step()
        events = sched.events[first_event:]
        retracted = tuple(e.rid for e in events if e.kind == "retract")
        finished = tuple(e.rid for e in events if e.kind in ("finish", "abort"))
        batch = self._batch if record.kind != "idle" else _NO_BATCH
        chunked = sched.chunked_req.rid if sched.chunked_req is not None else None
        return StepObservation(record.step, record.kind, *batch, self._evicted, retracted, finished,
                               record.available, record.evictable, record.protected, sched.clock_ms,
                               tuple(r.rid for r in sched.waiting), tuple(r.rid for r in sched.running.reqs),
                               chunked, sched.new_token_ratio, self._host_used())

    def steps(self, limit: int) -> list[StepObservation]:
        """The next step, or, where the fast path takes one (`memcli.sched.decode_run`), a run
        of up to `limit` steady decode steps, each observed as `step` observes it: the slots
        each step wrote are read off the request rows, the sizes off the run's records, and
        the requests that finished in a step (its events) leave the batch from that step on."""
        sched = self.scheduler
        runs = None if self.plain_loop else sched.decode_runs
        steps = 0 if runs is None or limit < 2 else runs.steady(limit)
        self.run_rows = None
        if not steps:
            return [self.step()]
        batch = sched.running
        self.run_rows = []
        rids, rows, lengths = [r.rid for r in batch.reqs], batch.req_pool_indices.numpy(), batch.seq_lens_cpu.numpy()
        ratio = sched.new_token_ratio
        first_event = len(sched.events)
        taken = runs.take(steps, math.inf)
        finished: dict[int, list[str]] = {}  # step -> the requests that finished in it (and left its batch)
        for event in sched.events[first_event:]:
            if event.kind in ("finish", "abort"):
                finished.setdefault(event.step, []).append(event.rid)
        table = self.stack.memory.req_to_token_pool.req_to_token.numpy()
        waiting, host_used, seen = tuple(r.rid for r in sched.waiting), self._host_used(), []
        members = np.ones(len(rids), dtype=bool)
        for j, record in enumerate(sched.records[-taken:]):
            ratio = sched.decayed_token_ratio(ratio)
            done = finished.get(record.step, ())
            if done:
                members &= ~np.isin(np.array(rids, dtype=object), done)
            at = np.flatnonzero(members)
            step_rids = tuple(rids[i] for i in at)
            self.run_rows.append(tuple(rows[at].tolist()))
            seen.append(StepObservation(record.step, "decode", step_rids, (), (),
                                        _ints(table[rows[at], lengths[at] + j]), 0, (), tuple(done),
                                        record.available, record.evictable, record.protected, record.time_ms,
                                        waiting, step_rids, None, ratio, host_used))
        return seen

    def _host_used(self) -> int:
        host = self.stack.host_pool
        return host.used_size() if host is not None else 0


MAX_RUN_STEPS = 1024  # the longest run of steady decode steps memcli takes at once

HOST_COPIES_NOTE = ("host tier: every copy between the device and the host finishes when it is issued, on both sides"
                    " (SGLang's cache controller runs as a synchronous stand-in): sim.host_bandwidth_gbps and"
                    " sim.host_latency_us are not used")


class StepDiff(NamedTuple):
    """The result of a side-by-side run."""

    steps: int  # steps compared
    divergence: Optional[tuple[StepObservation, StepObservation]]  # (sglang, memcli) at the first difference
    reference_s: float  # wall time of the reference loop's steps
    memcli_s: float
    event_loop: str = "overlap"  # the loop compared (semantics.event_loop)
    notes: tuple[str, ...] = ()  # how the run differs from the config as given
    failure: Optional[str] = None  # a side that raised instead of taking its step: which, where, what


def run_side_by_side(config: Config, requests: Sequence[RequestSpec], arrivals: str, output_token_base: int,
                     max_steps: Optional[int] = None, ref: Any = None,
                     on_step: Optional[Callable[[StepObservation, StepObservation], None]] = None,
                     plain_loop: bool = False) -> StepDiff:
    """Step SGLang's loop (normal or overlap, as `semantics.event_loop` says) and memcli's
    scheduler together until both are done, one of them
    is done early (a divergence in `kind`), or their observations differ. `on_step(sglang,
    memcli)` sees both observations of every step taken, the divergent one included. memcli
    takes steady decode runs at once unless `plain_loop`; each of their steps is compared."""
    loop = reference_loop(config, requests, arrivals, output_token_base, ref=ref)
    notes = (HOST_COPIES_NOTE,) if config.cache.kind == "hiradix" else ()
    try:
        mem = MemcliSide(config, requests, arrivals, output_token_base, plain_loop)
        steps, ref_s, mem_s = 0, 0.0, 0.0
        while not (loop.is_done() and mem.is_done()) and (max_steps is None or steps < max_steps):
            side = "memcli's scheduler"
            try:  # memcli first: a run of decode steps is compared step by step with SGLang's steps
                start = time.perf_counter()
                limit = MAX_RUN_STEPS if max_steps is None else max_steps - steps
                seen = [_idle_observation(mem.scheduler.step_count, None)] if mem.is_done() else mem.steps(limit)
                mem_s += time.perf_counter() - start
                for mem_obs in seen:
                    side, start = "SGLang's loop", time.perf_counter()
                    ref_obs = _idle_observation(loop.step_count, loop) if loop.is_done() else _step(loop)
                    ref_s += time.perf_counter() - start
                    steps += 1
                    if on_step is not None:
                        on_step(ref_obs, mem_obs)
                    if ref_obs != mem_obs or (mem_obs is seen[-1] and loop.is_done() != mem.is_done()):
                        return StepDiff(steps, (ref_obs, mem_obs), ref_s, mem_s, config.behaviour.event_loop, notes)
            except RAISED as exc:  # a side's own check: a finding, not a crash (memcli.reference.failure)
                if debugging():
                    raise
                failure = raised_at(side, steps, what_raised(exc))
                return StepDiff(steps, None, ref_s, mem_s, config.behaviour.event_loop, notes, failure)
        return StepDiff(steps, None, ref_s, mem_s, config.behaviour.event_loop, notes)
    finally:
        loop.close()


def _step(loop: ReferenceLoop) -> StepObservation:
    loop.step()
    return observe_reference(loop)


def _idle_observation(step: int, loop: Optional[ReferenceLoop]) -> StepObservation:
    """Stands for a side that is already done, so that the other side's extra step shows."""
    sizes = loop.sizes() if loop is not None else (-1, -1, -1)
    return StepObservation(step, "done", (), (), (), (), 0, (), (), *sizes)
