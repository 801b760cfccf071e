"""vLLM 0.33's v1 scheduler (`vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule` and
`update_from_output`) over memcli's block manager, under a model that samples one token for
every request whose scheduled chunk reaches its last token.

One step:
1. running requests first, in order: each gets `min(remaining, long-prefill threshold when
   > 0 and more than one request is eligible, budget)` tokens; when its slots do not fit, a
   victim is preempted (blocks freed, recomputed later, back in the waiting queue) until they
   fit or the request preempted itself: under FCFS the latest running request, put at the
   front of the queue, and the step's running pass stops at a self-preemption; under
   `priority` the running request of the largest (priority, arrival time), pushed back on the
   waiting heap, its tokens given back to the budget if it was scheduled earlier in the step,
   and a self-preempted request lets the pass go on to the next running one;
2. waiting requests next, only when nothing was preempted, while budget remains and fewer
   than `max_num_seqs` run, in arrival order (FCFS) or by (priority, arrival time, request id)
   (`priority`, `memcli/vllm_sched/queues.py`): prefix lookup, the whole prompt must fit
   (`scheduler_reserve_full_isl`), and a failed allocation stops admission for the step;
3. the step's output: computed tokens advance, a request whose chunk completed samples one
   token, and a request at `max_tokens` outputs (or `max_model_len`) finishes and is freed.

Loops (`semantics.event_loop`): `sync` is `Scheduler` with the engine core's plain step (each
step's output processed before the next is scheduled); `async` is `AsyncScheduler` with the
engine core's batch queue of two (`step_with_batch_queue`): step N+1 is scheduled before step
N's output is processed, a request whose step samples holds an output placeholder until then,
and a request preempted with a step in flight is skipped by admission until that step's
(stale) output has come back. The simulated step costs `sim.step_base_ms + prefill_token_us x prefill
tokens + decode_req_us x decoding requests + kv_read_ns x context tokens read`.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Optional

import numpy as np

from memcli.errors import StalledError
from memcli.mem_cache.block_manager import BlockManager
from memcli.steps import Event, SchedulerHooks, SchedulerStats, StepBatch, StepRecord
from memcli.vllm_sched.queues import PriorityWaiting
from memcli.vllm_sched.request import (FINISHED_ABORTED, FINISHED_LENGTH, PREEMPTED, RUNNING, WAITING, VllmRequest)

POLICIES = ("fcfs", "priority")  # vLLM 0.33's SchedulingPolicy


class VllmSchedulerConfig:
    """The scheduler settings vLLM reads (names are vLLM's)."""

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 long_prefill_token_threshold: int = 0, policy: str = "fcfs", enable_chunked_prefill: bool = True,
                 reserve_full_isl: bool = True, async_scheduling: bool = False):
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.max_model_len, self.long_prefill_token_threshold = max_model_len, long_prefill_token_threshold
        if policy not in POLICIES:
            raise ValueError(f"vLLM 0.33 has no {policy} policy; only {', '.join(POLICIES)}")
        self.policy, self.enable_chunked_prefill, self.reserve_full_isl = policy, enable_chunked_prefill, reserve_full_isl
        self.async_scheduling = async_scheduling


class StepPlan:
    """What one `schedule()` decided: tokens per request, in schedule order, and preemptions."""

    def __init__(self):
        self.num_scheduled: dict[str, int] = {}
        self.reqs: list[VllmRequest] = []
        self.preempted: list[str] = []
        self.sampled: dict[str, int] = {}  # the token each request sampled
        self.block_ids: dict[str, list[int]] = {}  # blocks after scheduling (kept plans only)
        self.samples: list[VllmRequest] = []  # requests whose chunk completes: they sample one token
        self.admitted_hits: dict[str, int] = {}  # prefix tokens reused by the requests admitted in this step
        self.cost_ms = 0.0

    @property
    def hits(self) -> int:
        """Prefix tokens reused by this step's admissions, together."""
        return sum(self.admitted_hits.values())


class VllmScheduler:
    """vLLM's scheduler and engine-core loop; `step()` is one engine-core step."""

    def __init__(self, memory: BlockManager, settings: VllmSchedulerConfig, sim: Any, hooks: SchedulerHooks):
        self.memory, self.settings, self.sim, self.hooks = memory, settings, sim, hooks
        self.checker = memory.checker(hooks.checks)
        self.clock_ms, self.step_count = 0.0, 0
        memory.set_clock(lambda: self.clock_ms)  # eviction ages on the simulated clock
        self.priority = settings.policy == "priority"
        self.waiting: Any = PriorityWaiting() if self.priority else deque()
        self.running: list[VllmRequest] = []
        self.finished: list = []
        self.records: list[StepRecord] = []
        self.stats = SchedulerStats()
        self._prefix_cache_seen = (0, 0, 0, 0, 0, 0)  # the block manager's counters at the last step
        self.next_token = hooks.output_token_base
        self.in_flight: deque = deque()  # async: scheduled steps whose output is not processed
        self.plans: list[StepPlan] = []  # kept only when `keep_plans` (differential tests)
        self.processed: list[StepPlan] = []  # plans whose output this step processed (kept plans only)
        self.keep_plans = False
        self._seq = 0
        self.events: list[Event] = []  # this step's events, when hooks.record_events (the caller clears it)
        self._evicted_seen = 0
        self._step_batch: Optional[StepBatch] = None  # the batch launched this step, when hooks.record_batches

    # -- requests in ----------------------------------------------------------------------
    def new_req(self, rid: str, input_ids, max_new_tokens: int, extra_key: Optional[str] = None,
                arrival_ms: float = 0.0, priority: int = 0) -> VllmRequest:
        self._seq += 1
        tokens = input_ids if isinstance(input_ids, np.ndarray) else [int(t) for t in input_ids]
        req = VllmRequest(rid, tokens, max_new_tokens, extra_key, arrival_ms, priority=priority, seq=self._seq)
        self.memory.hash_request(req)
        return req

    def add_request(self, req: VllmRequest) -> None:
        """vLLM's input processor rejects a prompt that leaves no room for one output token
        (`num_prompt_tokens >= max_model_len`): it never reaches the scheduler (aborted)."""
        self._event("arrive", req.request_id, req.num_prompt_tokens)
        if req.num_prompt_tokens >= self.settings.max_model_len:
            req.aborted = req.finished = True
            req.status, req.finish_ms = FINISHED_ABORTED, self.clock_ms
            self.stats.aborted += 1
            self.finished.append(req)
            self._event("abort", req.request_id, req.num_prompt_tokens)
            return
        self.waiting.append(req)

    def _event(self, kind: str, rid: str, tokens: int = 0) -> None:
        if self.hooks.record_events:
            self.events.append(Event(self.step_count, self.clock_ms, kind, rid, tokens))

    def is_done(self) -> bool:
        return not self.waiting and not self.running and not self.in_flight

    def active_reqs(self) -> list:
        return list(self.running)

    memory_holders = active_reqs

    def _has_work(self) -> bool:
        """Requests the scheduler can see now (vLLM's `has_requests`): running or arrived."""
        return bool(self.running) or self._arrived_waiting() > 0

    # -- one engine-core step -------------------------------------------------------------
    def step(self) -> StepRecord:
        if self.keep_plans:
            self.processed = []
        if self.settings.async_scheduling:
            kind, batch, new_tokens = self._step_with_batch_queue()
        else:
            kind, batch, new_tokens = self._step_sync()
        record = self._record(kind, batch, new_tokens)
        self.step_count += 1
        if self.checker.after_step(record.step, self.memory_holders(), kind == "idle"):
            self.stats.checks_run += 1
        if self.hooks.on_step is not None:
            self.hooks.on_step(self, record)
        return record

    def _step_sync(self) -> tuple[str, int, int]:
        if not self._has_work():
            return self._idle()
        plan = self._launch()
        if not plan.reqs:
            return self._idle()
        self._process(plan)
        return self._kind(plan)

    def _step_with_batch_queue(self) -> tuple[str, int, int]:
        """`EngineCore.step_with_batch_queue` with a queue of two: schedule when there are
        requests; process the oldest step's output only when the queue is full or nothing
        more could be scheduled."""
        plan = None
        if self._has_work():
            plan = self._launch()
            self.in_flight.appendleft(plan)
            if len(self.in_flight) < 2 and (plan.reqs or self._has_work()):
                return self._kind(plan)
        elif not self.in_flight:
            return self._idle()
        if plan is not None and not plan.reqs and not self.running and not any(p.reqs for p in self.in_flight):
            self.in_flight.clear()
            return self._idle()  # nothing runs, nothing is in flight: stalled, or waiting for arrivals
        self._process(self.in_flight.pop())
        return self._kind(plan) if plan is not None else ("idle", 0, 0)

    def _kind(self, plan: StepPlan) -> tuple[str, int, int]:
        if not plan.reqs:
            return "idle", 0, 0
        new = sum(plan.num_scheduled.values())
        return ("prefill" if plan.prefill_tokens else "decode"), len(plan.reqs), new

    def _idle(self) -> tuple[str, int, int]:
        arrived = [r for r in self.waiting if r.arrival_ms <= self.clock_ms]
        if arrived and not self.running and not any(p.reqs for p in self.in_flight):
            r = arrived[0]
            raise StalledError(f"request {r.request_id} ({r.num_tokens} tokens) cannot be admitted into an idle pool"
                               f" of {self.memory.size} tokens")
        later = [r.arrival_ms for r in self.waiting if r.arrival_ms > self.clock_ms]
        if later and not self.running:
            self.clock_ms = min(later)
        self.stats.idle_steps += 1
        return "idle", 0, 0

    def _launch(self) -> StepPlan:
        """Schedule a step, advance the requests by it (vLLM's `_update_after_schedule`),
        and run it on the simulated clock."""
        plan = self.schedule()
        self._hand_out_prefix_cache_stats()
        if self.keep_plans:
            plan.block_ids = {r.request_id: self.memory.block_ids(r) for r in plan.reqs}
            self.plans.append(plan)
        prefill_tokens = decode_reqs = kv_read = 0
        for req in plan.reqs:
            n = plan.num_scheduled[req.request_id]
            if req.num_computed_tokens < req.num_prompt_tokens or n > 1:
                prefill_tokens += n
            else:
                decode_reqs += 1
            kv_read += req.num_computed_tokens
            req.num_computed_tokens += n
            req.num_in_flight_tokens += n
            req.is_prefill_chunk = req.num_computed_tokens < req.num_tokens + req.num_output_placeholders
            if not req.is_prefill_chunk:
                plan.samples.append(req)
                if self.settings.async_scheduling:
                    req.num_output_placeholders += 1
        plan.prefill_tokens = prefill_tokens
        if self.hooks.record_batches and plan.reqs:
            self._step_batch = StepBatch(tuple(r.request_id for r in plan.reqs),
                                         tuple(plan.admitted_hits.get(r.request_id, 0) for r in plan.reqs),
                                         tuple(plan.num_scheduled[r.request_id] for r in plan.reqs))
        if plan.reqs:
            sim = self.sim
            self.clock_ms += (sim.step_base_ms + sim.prefill_token_us * prefill_tokens / 1e3
                              + sim.decode_req_us * decode_reqs / 1e3 + sim.kv_read_ns * kv_read / 1e6)
            if prefill_tokens:
                self.stats.prefill_batches += 1
                self.stats.batch_cached_tokens.append(plan.hits)
                self.stats.batch_new_tokens.append(prefill_tokens)
            else:
                self.stats.decode_steps += 1
        return plan

    def _hand_out_prefix_cache_stats(self) -> None:
        """The step's `PrefixCacheStats` (vLLM's `make_stats` hands them out every step and
        resets them), kept when the step admitted a request, fresh or preempted."""
        st = self.memory.stats
        now = (st.requests, st.queries, st.hits, st.preempted_requests, st.preempted_queries, st.preempted_hits)
        last, self._prefix_cache_seen = self._prefix_cache_seen, now
        if now[0] != last[0] or now[3] != last[3]:
            self.stats.prefix_cache_steps.append(tuple(a - b for a, b in zip(now, last)))

    # -- scheduling -----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan, s, memory = StepPlan(), self.settings, self.memory
        budget = s.max_num_batched_tokens
        threshold = s.long_prefill_token_threshold if self._eligible() > 1 else 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_output_placeholders > 0 and \
                    req.num_computed_tokens + 2 - req.num_output_placeholders >= req.num_prompt_tokens + req.max_tokens:
                i += 1  # its last token is in flight
                continue
            n = req.num_tokens + req.num_output_placeholders - req.num_computed_tokens
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, s.max_model_len - req.num_computed_tokens - 1)
            if n <= 0:
                i += 1
                continue
            new = memory.allocate_slots(req, n)  # a refused allocation takes nothing
            if new is None:
                new, back, i = self._preempt_until_fits(plan, req, n, i)
                budget += back
            if new is None:
                if self.priority:
                    continue  # preempted itself: the next running request (now at i) may fit
                break
            plan.reqs.append(req)
            plan.num_scheduled[req.request_id] = n
            budget -= n
            i += 1
        if not plan.preempted:
            self._admit(plan, budget, threshold)
        return plan

    def _preempt_until_fits(self, plan: StepPlan, req: VllmRequest, n: int, i: int) -> tuple[Optional[list], int, int]:
        """After slots for `n` tokens of `req` (at `i` in `running`) were refused: preempt a
        victim and try again, until they fit or `req` is preempted (vLLM's loop, past its first
        try): (the new blocks or None, tokens given back to the budget by victims scheduled
        earlier in this step, the index of `req`, or of its successor once it is gone). Under
        FCFS the victim is always at or after `i`, so it gives nothing back."""
        back = 0
        while True:
            if self.priority:
                victim = max(self.running, key=_priority_key)
                at = self.running.index(victim)
                del self.running[at]
                i -= at < i
                if victim.request_id in plan.num_scheduled:
                    back += plan.num_scheduled.pop(victim.request_id)
                    plan.reqs.remove(victim)
            else:
                victim = self.running.pop()
            self._preempt(victim)
            plan.preempted.append(victim.request_id)
            if victim is req:
                return None, back, i
            new = self.memory.allocate_slots(req, n)
            if new is not None:
                return new, back, i

    def _preempt(self, req: VllmRequest) -> None:
        self.memory.free(req)
        self.stats.recomputed_tokens += req.num_computed_tokens
        req.status, req.num_computed_tokens = PREEMPTED, 0
        req.num_stale_output_tokens = req.num_in_flight_tokens
        req.num_output_placeholders = 0
        req.num_preemptions += 1
        self._event("retract", req.request_id, req.num_prompt_tokens)
        self.stats.retractions += 1
        self.stats.retracted_requests += 1
        self.waiting.appendleft(req)

    def _eligible(self) -> int:
        return len(self.running) + self._arrived_waiting()

    def _arrived_waiting(self) -> int:
        """Waiting requests that have arrived: all but a tail of later arrivals (requests join
        the queue in arrival order; preempted ones, arrived, go to its front)."""
        if self.priority:
            return self.waiting.arrived(self.clock_ms)
        waiting, clock, n = self.waiting, self.clock_ms, len(self.waiting)
        while n and waiting[n - 1].arrival_ms > clock:
            n -= 1
        return n

    def _admit(self, plan: StepPlan, budget: int, threshold: int) -> None:
        """The waiting queue in order (arrived requests only); a request with stale output in
        flight is skipped (put back in place), a failed allocation stops admission."""
        s, memory = self.settings, self.memory
        skipped = []
        while budget > 0 and self.waiting and len(self.running) < s.max_num_seqs:
            req = self.waiting[0]
            if req.arrival_ms > self.clock_ms:
                if not self.priority:
                    break  # FCFS: every later request arrives later still
                skipped.append(self.waiting.popleft())
                continue
            if req.num_stale_output_tokens:
                skipped.append(self.waiting.popleft())
                continue
            blocks, hit = memory.get_computed_blocks(req)
            n = req.num_tokens - hit
            if 0 < threshold < n:
                n = threshold
            if not s.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            new = memory.allocate_slots(req, n, hit, blocks, full_sequence_must_fit=s.reserve_full_isl,
                                        has_scheduled_reqs=bool(self.running))
            if new is None:
                break
            memory.record_prefix_cache_stats(req, hit)
            self.waiting.popleft()
            self.running.append(req)
            if req.first_cached_tokens is None:
                req.first_cached_tokens, req.admit_ms = hit, self.clock_ms
            self.stats.admission_queries += req.num_tokens
            self.stats.admission_hits += hit
            req.status, req.num_computed_tokens = RUNNING, hit
            plan.reqs.append(req)
            plan.num_scheduled[req.request_id] = n
            plan.admitted_hits[req.request_id] = hit
            self._event("admit", req.request_id, hit)
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    # -- a step's output ------------------------------------------------------------------
    def _process(self, plan: StepPlan) -> None:
        """vLLM's `update_from_output` under the fake model: each request whose chunk
        completed samples one token (a preempted request's stale one included)."""
        if self.keep_plans:
            self.processed.append(plan)
        sampling = {r.request_id for r in plan.samples}
        for req in plan.reqs:
            n = plan.num_scheduled[req.request_id]
            req.num_in_flight_tokens -= n
            stale = req.num_stale_output_tokens > 0
            if stale:
                req.num_stale_output_tokens -= n
            if req.is_finished or req.request_id not in sampling:
                continue
            token = self.next_token
            self.next_token += 1
            plan.sampled[req.request_id] = token
            running = req.status == RUNNING
            req.all_token_ids.append(token)
            req.output_ids.append(token)
            stopped = len(req.output_ids) >= req.max_tokens or req.num_tokens >= self.settings.max_model_len
            if not stale and req.num_output_placeholders > 0:
                req.num_output_placeholders -= 1
            # The new token's block is hashed (vLLM hashes it as the token is appended), then a
            # running request's full blocks are cached, in one call.
            self.memory.token_appended(req, req.num_computed_tokens - req.num_in_flight_tokens
                                       if not stale and running else None)
            if stopped:
                self._finish(req)

    def _finish(self, req: VllmRequest) -> None:
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.memory.free(req)
        req.status, req.finished, req.finish_ms = FINISHED_LENGTH, True, self.clock_ms
        self.stats.finished += 1
        self.finished.append(req)
        self._event("finish", req.request_id, len(req.output_ids))

    def _record(self, kind: str, batch_size: int, new_tokens: int) -> StepRecord:
        memory = self.memory
        evicted = memory.evicted_tokens_total
        if evicted > self._evicted_seen:
            self._event("evict", "", evicted - self._evicted_seen)
            self._evicted_seen = evicted
        batch, self._step_batch = self._step_batch, None
        u = memory.usage()
        held = memory.held_pages(u)
        record = StepRecord(self.step_count, self.clock_ms, kind, batch_size, new_tokens, len(self.running),
                            len(self.waiting), u.available, u.evictable, u.protected, held * memory.block_size, held,
                            batch=batch)
        self.records.append(record)
        return record


def _priority_key(req: VllmRequest) -> tuple:
    """vLLM's victim key under the priority policy: the largest (priority, arrival time) is
    preempted first (the first of equals in running order, as `max` picks)."""
    return req.priority, req.arrival_time
