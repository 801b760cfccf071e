"""The dynamic part of `check-page-size`: run a workload through the scheduler and check the
paged layout after every step.

One phase = one stack, one scheduler, one workload. After each step (and after the optional
fault hook) every check of `memcli.mem_cache.integrity.run_checks` runs, plus the scheduler-level
`chunk_alignment`. The phase stops at the first step with a violation; an exception raised
inside the stack is a violation too (`no_exception`), reported with its step and message.
When the step budget runs out, the requests still queued or running are aborted (drained)
and the idle state is checked. At the end, `completion` fails when the scheduler itself
aborted a request (out of memory, or never admissible) that fits the pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from memcli.tools.check_page_size.workload import AbortPlan, Workload
from memcli.mem_cache.integrity import CHECK_NAMES, CheckResult, failed, passed, run_checks
from memcli import engines
from memcli.engines import Scheduler
from memcli.steps import SchedulerHooks, StepRecord

FaultHook = Callable[[Scheduler, StepRecord], None]

# The tree check verifies sizes and pages after every step; the cache's own full walk (locks,
# child keys, eviction queue) runs every this many steps, at idle, and at the end.
TREE_WALK_EVERY = 16
PROGRESS_EVERY_S = 5.0

DYNAMIC_CHECKS = ("no_exception", *CHECK_NAMES, "chunk_alignment", "completion")
CHECK_DESCRIPTIONS = {
    "no_exception": "nothing inside the stack raised",
    "row_layout": "position t at offset t % page_size, consecutive slots within a page",
    "slot_range": "held slots are KV rows: not page 0, below kv_pool.rows",
    "page_sharing": "pages shared between requests only through the tree",
    "free_list": "free list: no duplicate, no page 0, nothing owned",
    "no_lost_page": "every page free, cached or held by one request",
    "conservation": "available + evictable + protected + held == size (tokens, pages)",
    "tree": "prefix cache sizes and pages (full walk every 16 steps and at idle)",
    "idle": "at idle: every row free, available + evictable == size",
    "chunk_alignment": "non-final prefill chunks end on a page boundary",
    "completion": "no request aborted by the scheduler although it fits",
    # On a block manager (vLLM's; `blocks.py`):
    "block_pool": "the manager's check: reference counts, free queue, cached map",
    "blocks_cover": "each running request holds cdiv(computed tokens, block size) blocks at least",
    "slot_mapping": "the KV-cache spec's slot of each computed block's first and last position lies in that block",
    "block_hashes": "one chained hash per full block of the cache's size (a new request's chain recomputed)",
    "kv_events": "every BlockStored carries block_size x (its hashes) token ids, at the cache's block size",
    "router": "a KV-aware router cuts every BlockStored's token ids into one full chunk per block hash",
}


@dataclass(frozen=True)
class CheckRow:
    """One dynamic check over a whole phase: "pass", "fail", or "skipped" (never reached)."""

    name: str
    status: str
    detail: str

    @property
    def ok(self) -> bool:
        return self.status != "fail"

    @property
    def what(self) -> str:
        return CHECK_DESCRIPTIONS[self.name]

    def to_dict(self) -> dict:
        return {"name": self.name, "what": self.what, "status": self.status, "ok": self.ok, "detail": self.detail}


@dataclass(frozen=True)
class PhaseResult:
    """What one phase ran, what it covered, and the first violation (None when clean)."""

    name: str
    cache_kind: str
    workload: str
    pool_tokens: int
    page_size: int
    steps: int
    seconds: float
    checks: list[CheckRow]
    coverage: dict[str, float]
    violation: Optional[CheckResult]
    also_failed: list[CheckResult] = field(default_factory=list)
    event_loop: str = "overlap"  # the scheduler loop (semantics.event_loop)

    @property
    def ok(self) -> bool:
        return self.violation is None

    @property
    def unfinished(self) -> int:
        """Requests still queued or running when the step limit stopped the phase (then aborted)."""
        return int(self.coverage.get("drained", 0))

    def to_dict(self) -> dict:
        return {
            "name": self.name, "event_loop": self.event_loop, "cache_kind": self.cache_kind,
            "workload": self.workload, "ok": self.ok, "unfinished": self.unfinished,
            "pool_tokens": self.pool_tokens, "page_size": self.page_size, "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "checks": [c.to_dict() for c in self.checks],
            "coverage": self.coverage,
            "first_violation": violation_dict(self.violation) if self.violation else None,
            "also_failed_at_that_step": [violation_dict(v) for v in self.also_failed],
        }


def violation_dict(result: CheckResult) -> dict:
    """A failed check as this tool's JSON prints it (`check`, `step`, `rid`, `positions`, `slots`, `detail`)."""
    return {"check": result.name, "step": result.step, "rid": result.rid, "positions": list(result.positions),
            "slots": list(result.slots), "detail": result.detail}


def run_phase(name: str, stack, config, workload: Workload, steps: int,
              fault_hook: Optional[FaultHook] = None,
              progress: Optional[Callable[[str], None]] = None) -> PhaseResult:
    """Run `workload` on `stack` for at most `steps` steps, checking after every step.

    `progress(message)` is called every few seconds of a long phase."""
    start = time.perf_counter()
    sched = engines.get(config).scheduler(stack.memory, config, SchedulerHooks(
        output_token_base=workload.output_token_base, retract_every=workload.retract_every,
        page_size=stack.scheduler_page_size))
    run = _PhaseRun(sched, workload)
    run.progress = (lambda step: progress(f"{name}: step {step} of at most {steps}")) if progress else None
    violations = run.loop(steps, fault_hook)
    cache_kind = type(stack.tree_cache).__name__
    return PhaseResult(name, cache_kind, workload.description, stack.allocator.size, stack.allocator.page_size,
                       sched.step_count, time.perf_counter() - start, run.checks(), run.coverage(),
                       violations[0] if violations else None, violations[1:], config.behaviour.event_loop)


class _PhaseRun:
    """The step loop of one phase, with its tallies."""

    def __init__(self, sched: Scheduler, workload: Workload):
        self.sched = sched
        self.stack = sched.memory.stack  # the components, for the fault hooks and the checks
        self.ps = self.stack.allocator.page_size
        self.reqs = []
        for spec in workload.requests:
            req = sched.new_req(spec.rid, spec.input_ids(), spec.output_len, spec.extra_key, spec.arrival_ms or 0.0)
            sched.add_request(req)
            self.reqs.append(req)
        self.abort_plans: list[AbortPlan] = list(workload.aborts)
        self.planned: dict[str, str] = {}
        self.drained: set[str] = set()
        self.results: dict[str, CheckResult] = {}
        self.steps_checked = 0
        self.idle_points = 0
        self.busiest: dict[str, int] = {}
        self.counts = dict.fromkeys(("page_boundary_decodes", "prefill_chunks"), 0)
        self.chunked_rids: set[str] = set()
        self.chunk_len: dict[str, int] = {}
        self.waste_tokens = self.waste_samples = 0
        self.progress: Optional[Callable[[int], None]] = None

    # -- the loop ---------------------------------------------------------------------------

    def loop(self, steps: int, fault_hook: Optional[FaultHook]) -> list[CheckResult]:
        sched = self.sched
        reported = time.perf_counter()
        while not sched.is_done() and sched.step_count < steps:
            step = sched.step_count
            if self.progress is not None and time.perf_counter() - reported > PROGRESS_EVERY_S:
                self.progress(step)
                reported = time.perf_counter()
            decoding = [(req, req.kv_allocated_len) for req in sched.running.reqs]
            try:
                self._planned_aborts(step)
                record = sched.step()
            except Exception as exc:  # noqa: BLE001 - any failure inside the stack is the finding
                return [self._exception(step, "during step", exc)]
            self._count(record, decoding)
            if fault_hook is not None:
                fault_hook(sched, record)
            violations = self._check(step)
            if violations:
                return violations
        return self._drain() or self._completion()

    def _planned_aborts(self, step: int) -> None:
        for plan in list(self.abort_plans):
            if step < plan.from_step:
                continue
            req = self._abort_target(plan.where)
            if req is not None:
                self.planned[req.rid] = plan.where
                self.abort_plans.remove(plan)
                self.sched.abort(req.rid)

    def _abort_target(self, where: str):
        sched = self.sched
        if where == "chunked":
            return sched.chunked_req
        if where == "running":
            return sched.running.reqs[-1] if sched.running.reqs else None
        queue = sched.waiting or list(sched.pending)
        return queue[-1] if queue else None

    def _drain(self) -> list[CheckResult]:
        """Abort what the step budget left queued or running, then check the idle state."""
        sched = self.sched
        left = [*sched.pending, *sched.waiting, *sched.active_reqs()]
        step = sched.step_count
        try:
            for req in left:
                self.drained.add(req.rid)
                sched.abort(req.rid)
        except Exception as exc:  # noqa: BLE001
            return [self._exception(step, "while draining the queue after step", exc)]
        return self._check(step, full_tree_walk=True)

    def _exception(self, step: int, where: str, exc: Exception) -> CheckResult:
        detail = f"{type(exc).__name__} raised inside the stack {where} {step}: {exc}".strip()
        self.results["no_exception"] = failed("no_exception", detail).at_step(step)
        return self.results["no_exception"]

    # -- checks -----------------------------------------------------------------------------

    def _check(self, step: int, full_tree_walk: bool = False) -> list[CheckResult]:
        active = self.sched.memory_holders()
        full_tree_walk = full_tree_walk or not active or self.steps_checked % TREE_WALK_EVERY == 0
        try:
            results = run_checks(self.stack, active, full_tree_walk)
        except Exception as exc:  # noqa: BLE001 - a state too broken to walk is a finding too
            return [self._exception(step, "while checking the state after step", exc)]
        results.append(self._chunk_alignment())
        self.steps_checked += 1
        self.idle_points += not active
        for result in results:
            self._keep(result, len(active))
        return [r.at_step(step) for r in results if not r.ok]

    def _keep(self, check: CheckResult, busy: int) -> None:
        """Keep a failure for good; otherwise the numbers of the busiest step (idle: the last idle one)."""
        name = check.name
        kept = self.results.get(name)
        if kept is not None and not kept.ok:
            return
        if not check.ok or (busy >= self.busiest.get(name, -1) if name != "idle" else busy == 0):
            self.results[name] = check
            self.busiest[name] = busy

    def _chunk_alignment(self) -> CheckResult:
        req = self.sched.chunked_req
        if req is None or req.kv_allocated_len == 0 or req.kv_allocated_len % self.ps == 0:
            return passed("chunk_alignment", f"{self.counts['prefill_chunks']} non-final chunks,"
                                             f" all ending on a page boundary of {self.ps}")
        n = req.kv_allocated_len
        slot = int(self.stack.req_to_token_pool.req_to_token[req.req_pool_idx, n - 1])
        detail = (f"request {req.rid} was chunked after {n} tokens: its last computed position {n - 1} is at"
                  f" offset {(n - 1) % self.ps} of a page of {self.ps}; the prefill budget rounds with page size"
                  f" {self.sched.page_size}, the allocator pages by {self.ps}")
        return failed("chunk_alignment", detail, req.rid, (n - 1,), (slot,))

    def _completion(self) -> list[CheckResult]:
        oom = {(e.rid, e.step) for e in self.sched.events if e.kind == "oom"}
        for event in self.sched.events:
            if event.kind != "abort" or event.rid in self.planned or event.rid in self.drained:
                continue
            why = "decode out of memory" if (event.rid, event.step) in oom else "it could never be admitted"
            detail = f"request {event.rid} was aborted by the scheduler at step {event.step} ({why}) although it fits"
            self.results["completion"] = failed("completion", detail, event.rid).at_step(event.step)
            return [self.results["completion"]]
        done = sum(1 for r in self.reqs if r.finished and r.rid not in self.planned and r.rid not in self.drained)
        detail = f"{done} of {len(self.reqs)} requests finished"
        if self.planned:
            detail += f", {len(self.planned)} aborted by the workload"
        if self.drained:
            detail += f", {len(self.drained)} stopped unfinished at the step limit"
        self.results["completion"] = passed("completion", detail)
        return []

    def checks(self) -> list[CheckRow]:
        rows = []
        for name in DYNAMIC_CHECKS:
            check = self.results.get(name)
            if check is not None and not check.ok:
                rows.append(CheckRow(name, "fail", check.detail))
            elif check is not None:
                rows.append(CheckRow(name, "pass", self._pass_detail(name, check.detail)))
            elif name == "no_exception":
                rows.append(CheckRow(name, "pass", f"{self.sched.step_count} steps ran, {self.steps_checked} checked"))
            else:
                rows.append(CheckRow(name, "skipped", f"not reached: the run stopped at step {self.sched.step_count}"))
        return rows

    def _pass_detail(self, name: str, detail: str) -> str:
        if name == "completion":
            return detail
        if name == "idle":
            return f"{self.idle_points} idle points of {self.steps_checked} checked steps; last: {detail}"
        busy = self.busiest.get(name, 0)
        return f"busiest step ({busy} requests holding memory): {detail}"

    # -- coverage ---------------------------------------------------------------------------

    def _count(self, record: StepRecord, decoding: list) -> None:
        if record.kind == "decode":
            self.counts["page_boundary_decodes"] += sum(
                1 for req, old in decoding if req.kv_allocated_len == old + 1 and old % self.ps == 0)
        req = self.sched.chunked_req
        if req is not None and self.chunk_len.get(req.rid) != req.kv_allocated_len:
            self.chunk_len[req.rid] = req.kv_allocated_len
            self.chunked_rids.add(req.rid)
            self.counts["prefill_chunks"] += 1
        for req in self.sched.active_reqs():
            self.waste_tokens += -req.kv_allocated_len % self.ps
            self.waste_samples += 1

    def coverage(self) -> dict[str, float]:
        stats, ps = self.sched.stats, self.ps
        prefilled = [r for r in self.reqs if r.first_cached_tokens is not None]
        hits = [r for r in prefilled if r.first_cached_tokens > 0]
        log = getattr(self.stack.tree_cache, "eviction_log", [])
        where = list(self.planned.values())
        return {
            "requests": len(self.reqs),
            "finished": stats.finished,
            "prefill_batches": stats.prefill_batches,
            "decode_steps": stats.decode_steps,
            "radix_hits": len(hits),
            "cached_tokens": sum(r.first_cached_tokens for r in hits),
            "prompts_ending_mid_page": sum(1 for r in prefilled if r.input_len % ps),
            "chunked_requests": len(self.chunked_rids),
            "prefill_chunks": self.counts["prefill_chunks"],
            "page_boundary_decodes": self.counts["page_boundary_decodes"],
            "evictions": len(log),
            "evicted_tokens": sum(e.tokens for e in log),
            "pressure_retractions": stats.retractions - stats.forced_retractions,
            "forced_retractions": stats.forced_retractions,
            "retracted_requests": stats.retracted_requests,
            "aborts_waiting": where.count("waiting"),
            "aborts_running": where.count("running"),
            "aborts_chunked": where.count("chunked"),
            "scheduler_aborts": max(stats.aborted - len(self.planned) - len(self.drained), 0),
            "prefill_ooms": stats.oom_events,
            "drained": len(self.drained),
            "mean_partial_page_waste": round(self.waste_tokens / self.waste_samples, 3) if self.waste_samples else 0.0,
        }
