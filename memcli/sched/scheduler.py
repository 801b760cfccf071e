"""The scheduler loop with a simulated forward step.

One `step()` of the normal loop (SGLang's `event_loop_normal`): admit arrivals, then run a
prefill batch if the budget admits one (prefill has priority), else decode the running batch
(retracting when its next step does not fit), else idle (the clock jumps to the next arrival
and the idle check runs); each batch's result is processed in its own step. Under
`semantics.event_loop: overlap` a step is one iteration of SGLang's `event_loop_overlap`
instead (`memcli.sched.overlap`): the result of a batch is processed one step later. There is
no model: each output token is a fresh id, and the simulated clock advances by the cost model
of `SimConfig`. Every arrival, admission, allocation, finish, retraction and abort is recorded.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from operator import attrgetter

from memcli.config import REQ_INPUT_MARGIN, Config
from memcli.errors import ConfigError
from memcli.mem_cache.manager import MemoryManager, Release
from memcli.mem_cache.pages import output_room
from memcli.sched.batch import ScheduleBatch
from memcli.sched.decode_run import DecodeRuns
from memcli.sched.overlap import OverlapLoop
from memcli.sched.progress import ProgressGuard
from memcli.sched.policy import AddResult, AdmissionGate, PrefillAdder, order_waiting, uses_lpm
from memcli.sched.req import Req
from memcli.steps import NO_BATCH, Event, SchedulerHooks, SchedulerStats, StepBatch, StepRecord

__all__ = ["Event", "Scheduler", "SchedulerHooks", "SchedulerStats", "StepRecord"]

# SGLang 0.5.23's waiting-prefix refresh (schedule_policy.py): every 32nd ordering, 128 requests.
WAITING_PREFIX_REFRESH_INTERVAL = 32
WAITING_PREFIX_REFRESH_MAX = 128
_kv = attrgetter("kv")


class Scheduler:
    def __init__(self, memory: MemoryManager, config: Config, hooks: SchedulerHooks = SchedulerHooks()):
        self.memory = memory
        self.cfg = config.scheduler
        self.sim = config.sim
        self.page_size = hooks.page_size or memory.page_size
        self.device = memory.device
        self.max_running = memory.max_running
        self.checker = hooks.checker or memory.checker(hooks.checks)
        self.retract_every = hooks.retract_every
        self.record_events = hooks.record_events
        self.record_batches = hooks.record_batches
        self._step_batch: StepBatch | None = None  # this step's batch, for its record (record_batches)
        self.on_step = hooks.on_step
        # A decode run's records as columns (`StepRun`), where they carry no events nor batches.
        self.on_steps = None if hooks.record_events or hooks.record_batches else hooks.on_steps
        self.on_admission = hooks.on_admission
        self.next_token = hooks.output_token_base
        self.clock_ms, self.step_count = 0.0, 0
        self.pending: deque[Req] = deque()
        self.waiting: list[Req] = []
        behaviour = config.behaviour
        self.enable_overlap = behaviour.event_loop == "overlap"
        self.running = ScheduleBatch([], memory, self.enable_overlap)
        self.chunked_req: Req | None = None
        self.finished: list[Req] = []
        # Requests finished so far (`finish`, `_abort_waiting`), and that count when the running
        # batch last held no finished request (`filter_running`).
        self.finish_count = 0
        self._running_clean_at = 0
        self.events: list[Event] = []
        self.records: list[StepRecord] = []
        self.stats = SchedulerStats()
        self._evicted_seen = 0
        self.init_new_token_ratio = min(self.cfg.init_new_token_ratio, 1.0)
        self.min_new_token_ratio = self.init_new_token_ratio * self.cfg.min_new_token_ratio_factor
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / max(
            self.cfg.new_token_ratio_decay_steps, 1)
        self.new_token_ratio = self.init_new_token_ratio
        self.retract_to_front = behaviour.retract_requeue == "front"
        self.retract_keep_victim_order = behaviour.retract_batch_order == "victim_sort"
        self.defer_chunk_caching = behaviour.chunked_prefix in ("deferred", "deferred_row_kept")
        self.chunk_gives_back_row = behaviour.chunked_prefix == "deferred"
        self.align_chunks = behaviour.chunk_alignment == "page"
        self.admission_reserve = behaviour.admission_reserve
        self.skip_finishing_decode = behaviour.skip_finishing_decode == "skip"
        self.memory_clip = behaviour.request_limits == "memory_clip"
        self.chunk_instead = behaviour.rem_input_gate == "chunk"
        self.full_chunk = behaviour.chunk_progress == "full_chunk"
        self.release_committed = behaviour.overlap_release == "committed"
        self.ignore_eos_whole = behaviour.ignore_eos_ratio == "one"
        self.eos_extra_insert = behaviour.eos_extra_insert == "one"
        self.prefill_free_group = behaviour.prefill_free_group == "grouped"
        self.refresh_waiting = (behaviour.waiting_prefix_refresh == "touch" and memory.sharing
                                and config.cache.eviction_policy == "lru")
        self._refresh_calls = 0
        self.gate = AdmissionGate(behaviour.admission_gate, self.max_running)
        self.max_req_len = config.max_req_len
        self.chunk_to_cache: Req | None = None  # a chunk that enters the tree next step (deferred)
        self.progress_guard = ProgressGuard()
        self.overlap = OverlapLoop(self) if self.enable_overlap else None
        self.decode_runs = DecodeRuns(self) if self.enable_overlap else None  # the fast path (sched/decode_run.py)
        memory.set_clock(lambda: self.clock_ms)
        # Host tier: when finished copies are acknowledged (SGLang: when a prefill is tried).
        self.hierarchical = memory.host_tier() is not None
        self.ack_every_step = self.hierarchical and behaviour.hicache_ack == "every_step"
        self._host_seen = (0, 0)  # (d2h, h2d) bytes at the last step record

    # -- requests -----------------------------------------------------------------------
    def new_req(self, rid: str, input_ids, max_new_tokens: int, extra_key: str | None = None,
                arrival_ms: float = 0.0, priority: int = 0) -> Req:
        """`priority` is not read: SGLang's schedulers as reproduced have no priority policy."""
        return Req(rid, input_ids, max_new_tokens, self.device, extra_key, arrival_ms)

    def add_request(self, req: Req) -> None:
        """Queue a request; it arrives when the clock reaches `req.arrival_ms`. An `ignore_eos`
        request needs a sharing cache: without one SGLang admits it by `add_one_req_ignore_eos`,
        which is not modelled (ConfigError)."""
        if req.ignore_eos and not self.memory.sharing:
            raise ConfigError(f"request {req.rid} is ignore_eos, and cache.kind has no prefix sharing",
                              hint="use --set cache.kind=radix, or drop ignore_eos from the trace")
        self.pending.append(req)

    def active_reqs(self) -> list[Req]:
        """Requests that hold memory now: the running batch, the request being chunked and,
        under overlap, the last prefill batch (it joins the running batch next step)."""
        reqs = list(self.running.reqs)
        if self.overlap is not None:
            # Finished requests stay in the running batch until the next decode update.
            reqs = [r for r in reqs if not r.finished]
            reqs += [r for r in self.overlap.unmerged_reqs() if r is not self.chunked_req and not r.finished]
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        return reqs

    def memory_holders(self) -> list:
        """What the integrity checks count as holding memory: `active_reqs()` and, under
        overlap, the slots of released requests that a batch in flight still holds."""
        if self.overlap is None:
            return self.active_reqs()
        return [*self.active_reqs(), *self.overlap.in_flight_slots()]

    def running_may_hold_finished(self) -> bool:
        """False when no request finished since the running batch last held none: a request
        joins the running batch unfinished (a prefill's result keeps only those), and one
        finishes only through `finish`, which counts it. True is a maybe."""
        return self._running_clean_at != self.finish_count

    def filter_running(self) -> None:
        """`running.filter_batch()` (the finished leave), skipping its pass over the running
        requests when none can have finished since the last one."""
        if self.running_may_hold_finished():
            self.running.filter_batch()
            self._running_clean_at = self.finish_count

    def is_done(self) -> bool:
        busy = self.overlap is not None and self.overlap.busy()
        return not (self.pending or self.waiting or self.running.reqs or self.chunked_req or busy)

    def _event(self, kind: str, rid: str, tokens: int = 0) -> None:
        if self.record_events:
            self.events.append(Event(self.step_count, self.clock_ms, kind, rid, tokens))

    def next_output_token(self) -> int:
        self.next_token += 1
        return self.next_token - 1

    # -- the loop -------------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> None:
        while not self.is_done() and (max_steps is None or self.step_count < max_steps):
            self.step()

    def step(self) -> StepRecord:
        """One step. Raises `StalledError` (memcli.sched.progress) when the loop stops advancing."""
        before = self.progress_guard.marks(self)
        if self.ack_every_step:
            self.memory.ack_host_copies()
        if self.overlap is not None:
            kind, bs, new_tokens = self.overlap.iterate()
        else:
            kind, bs, new_tokens = self._iterate_normal()
        record = self._record(kind, bs, new_tokens)
        self.progress_guard.after_step(self, before)
        self.step_count += 1
        idle = kind == "idle"
        checker = self.checker
        holders = self.memory_holders() if checker.reads_holders(idle) else []
        if checker.after_step(record.step, holders, idle=idle):
            self.stats.checks_run += 1
        if self.on_step is not None:
            self.on_step(self, record)
        return record

    def _iterate_normal(self) -> tuple[str, int, int]:
        """One iteration of `event_loop_normal`; returns (kind, batch size, new tokens)."""
        self.admit_arrivals()
        self.cache_deferred_chunk(self.chunk_gives_back_row)
        batch = self.get_new_batch_prefill()
        if batch is not None:
            kind, bs, new_tokens = "prefill", batch.batch_size, batch.extend_num_tokens
            self.clock_ms += self.prefill_cost_ms(batch)
            self.process_prefill_result(batch)
        elif self.running.reqs:
            kind, bs, new_tokens = "decode", 0, 0
            decoded = self.update_running_batch()
            if decoded is not None:
                bs, new_tokens = decoded.batch_size, decoded.batch_size
                self.clock_ms += self.decode_cost_ms(decoded)
                self.process_decode_result(decoded)
        else:
            kind, bs, new_tokens = "idle", 0, 0
            self.idle()
        return kind, bs, new_tokens

    def admit_arrivals(self) -> None:
        limit = self.max_req_len
        while self.pending and self.pending[0].arrival_ms <= self.clock_ms:
            req = self.pending.popleft()
            self._event("arrive", req.rid, req.input_len)
            if limit is not None:  # SGLang's request limits (semantics.request_limits)
                if req.input_len >= limit - REQ_INPUT_MARGIN:
                    self._abort_waiting(req)
                    continue
                req.max_new_tokens = min(req.max_new_tokens, limit - req.input_len - 1)
                if self.memory_clip:  # 0.5.23's max_new_tokens_for_memory
                    req.max_new_tokens = min(req.max_new_tokens,
                                             output_room(self.memory.size, req.input_len, self.page_size))
            self.waiting.append(req)

    def cache_deferred_chunk(self, give_back_row: bool = True) -> None:
        """SGLang's start of a step: last step's chunk enters the tree, and the chunked request
        gives back its row (it takes a new one with its next piece)."""
        req, self.chunk_to_cache = self.chunk_to_cache, None
        if req is not None:
            self.memory.cache_unfinished(req, chunked=True)
            if give_back_row:
                self.memory.free_row(req)

    def idle(self) -> None:
        self.gate.decode_filtered()
        self.stats.idle_steps += 1
        self.new_token_ratio = self.init_new_token_ratio
        if self.pending and not self.waiting:
            self.clock_ms = max(self.clock_ms, self.pending[0].arrival_ms)
        elif self.waiting and self.hierarchical:
            # Waiting on memory that host copies in flight still lock: time passes until one ends.
            end = self.memory.next_copy_end()
            if end is not None:
                self.clock_ms = max(self.clock_ms, end)

    def _record(self, kind: str, bs: int, new_tokens: int) -> StepRecord:
        memory = self.memory
        evicted = memory.evicted_tokens_total
        if evicted > self._evicted_seen:
            self._event("evict", "", evicted - self._evicted_seen)
            self._evicted_seen = evicted
        u = memory.usage()
        held_pages = memory.held_pages(u)
        held_tokens = self._held_tokens()
        rows = memory.rows_in_use()
        self.stats.peak_request_rows = max(self.stats.peak_request_rows, rows)
        host = memory.host_tier()
        host_used = d2h = h2d = 0
        if host is not None:
            host_used = host.used
            d2h, h2d = host.d2h_bytes - self._host_seen[0], host.h2d_bytes - self._host_seen[1]
            self._host_seen = (host.d2h_bytes, host.h2d_bytes)
        batch = None
        if self.record_batches:
            batch, self._step_batch = self._step_batch or NO_BATCH, None
        record = StepRecord(self.step_count, self.clock_ms, kind, bs, new_tokens, len(self.running.reqs),
                            len(self.waiting), u.available, u.evictable, u.protected, held_tokens,
                            held_pages, host_used, d2h, h2d, batch)
        self.records.append(record)
        return record

    def _held_tokens(self) -> int:
        """Slots the requests holding memory own (`active_reqs()`, not yet freed) plus, under
        overlap, the decode slots in flight of released requests. One pass over the records."""
        running, chunked, held = self.running.reqs, self.chunked_req, 0
        # Plain loops rather than `sum` over a generator: this runs over the running batch
        # every step, and resuming a generator per request costs more than the addition.
        if self.overlap is None:
            for kv in map(_kv, running):
                if not kv.kv_freed:
                    held += kv.kv_allocated_len - kv.last_matched_prefix_len
        else:
            for r in running:
                if not r.finished:
                    kv = r.kv
                    if not kv.kv_freed:
                        held += kv.kv_allocated_len - kv.last_matched_prefix_len
            for r in self.overlap.unmerged_reqs():
                if r is not chunked and not r.finished and not (kv := r.kv).kv_freed:
                    held += kv.kv_allocated_len - kv.last_matched_prefix_len
            held += self.overlap.in_flight_count()
        if chunked is not None and not chunked.kv.kv_freed:
            held += chunked.kv.kv_allocated_len - chunked.kv.last_matched_prefix_len
        return held

    # -- prefill --------------------------------------------------------------------------
    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        gate = self.gate
        if not gate.may_try(bool(self.waiting), self.chunked_req is not None, len(self.running.reqs)):
            return None
        if self.hierarchical and not self.ack_every_step:
            self.memory.ack_host_copies()
        matched = uses_lpm(self.waiting, self.cfg.policy, self.memory)
        self.waiting = order_waiting(self.waiting, self.cfg.policy, self.memory)
        if self.refresh_waiting and not matched and self.waiting:
            self._touch_waiting_prefixes()
        adder = PrefillAdder(self.memory, self.running.reqs, self.new_token_ratio,
                             self.cfg.max_prefill_tokens, self.cfg.chunked_prefill_size, self.page_size,
                             self.cfg.max_new_tokens_clip, self.align_chunks, self.admission_reserve,
                             self.chunk_instead, self.full_chunk, self.ignore_eos_whole)
        chunked_pending = self.chunked_req
        if chunked_pending is not None:
            chunked_pending.init_next_round_input(None)
            still, added = adder.add_chunked_req(chunked_pending)
            if added:
                self.chunked_req = still
        for req in list(self.waiting):
            if adder.reserve and adder.budget_state() == AddResult.OTHER:
                break  # 0.5.23 checks the input and chunk budgets before each request
            if not gate.has_room(len(self.running.reqs), len(adder.can_run_list), self.chunked_req is not None):
                break
            if not matched:
                req.init_next_round_input(self.memory)
            has_chunked = self.chunked_req is not None or adder.new_chunked_req is not None
            if adder.reserve:
                result = adder.add_one_req_budget(req, has_chunked)
            else:
                result = adder.add_one_req(req, has_chunked)
            if req in adder.can_run_list:
                self.waiting.remove(req)
            if result != AddResult.CONTINUE:
                gate.stopped(result, self.hierarchical, len(adder.can_run_list), len(self.running.reqs))
                break
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if not adder.can_run_list:
            self._unstick()
            return None
        return self._prepare_prefill(adder.can_run_list, adder.log_hit_tokens, adder.log_input_tokens)

    def _touch_waiting_prefixes(self) -> None:
        """SGLang 0.5.23's `_touch_waiting_prefixes`: on the first and every 32nd ordering, the
        prefixes of the first 128 waiting requests are touched in the LRU, the head last."""
        refresh = self._refresh_calls % WAITING_PREFIX_REFRESH_INTERVAL == 0
        self._refresh_calls += 1
        if refresh:
            for req in reversed(self.waiting[:WAITING_PREFIX_REFRESH_MAX]):
                self.memory.touch_prefix(req.token_ids(req.seqlen), req.extra_key)

    def _unstick(self) -> None:
        """Nothing holds memory and the head request still cannot be admitted: the pool can
        never hold it, so abort it instead of waiting forever."""
        if self.running.reqs or self.chunked_req is not None or not self.waiting:
            return
        if self.memory.next_copy_end() is not None:
            return  # a copy in flight still locks memory: wait for it (see `_idle`)
        self._abort_waiting(self.waiting.pop(0))
        self.gate.shrank()  # nothing runs that could clear SGLang's batch_is_full flag

    def _abort_waiting(self, req: Req) -> None:
        req.aborted = req.finished = True
        self.finish_count += 1
        req.finish_ms = self.clock_ms
        self.stats.aborted += 1
        self._event("abort", req.rid, req.input_len)
        self.finished.append(req)

    def _prepare_prefill(self, reqs: list[Req], log_hit_tokens: int = 0, log_input_tokens: int = 0) -> ScheduleBatch | None:
        batch = ScheduleBatch(reqs, self.memory, self.enable_overlap)
        batch.load_end_ms = self.memory.start_load_backs()
        if not batch.prepare_for_extend():
            self._prefill_failed(reqs)
            return None
        self.stats.prefill_batches += 1
        self.stats.allocations += 1
        self.stats.allocated_tokens += batch.extend_num_tokens
        self.stats.batch_cached_tokens.append(log_hit_tokens)
        self.stats.batch_new_tokens.append(log_input_tokens)
        cached = []
        for req in reqs:
            hit = 0
            if req.first_cached_tokens is None:
                hit = req.first_cached_tokens = req.prefix_indices.shape[0]
                req.first_host_skipped = req.host_skipped_len
                req.admit_ms = self.clock_ms
                self._event("admit", req.rid, hit)
                self._admitted(req)
            elif req.retraction_count and req.kv_committed_len == 0:
                self.stats.recomputed_tokens += req.extend_input_len
                hit = len(req.prefix_indices)
                self._admitted(req)
            cached.append(hit)
        self._event("alloc", "", batch.extend_num_tokens)
        if self.record_batches:
            self._step_batch = StepBatch(tuple(r.rid for r in reqs), tuple(cached),
                                         tuple(int(r.extend_input_len) for r in reqs))
        return batch

    def _admitted(self, req: Req) -> None:
        self.stats.admission_queries += req.seqlen
        self.stats.admission_hits += req.prefix_indices.shape[0]
        if self.on_admission is not None:
            self.on_admission(req, True)

    def _prefill_failed(self, reqs: list[Req]) -> None:
        """Put the batch back (unlocking what admission locked) and record the OOM."""
        self.stats.oom_events += 1
        self._event("oom", reqs[0].rid, sum(r.extend_input_len for r in reqs))
        requeue = [r for r in reqs if r is not self.chunked_req]
        for req in requeue:
            self.memory.drop_prefix(req)
        self.waiting[:0] = requeue
        self._unstick()

    def prefill_result_frees(self):
        """The context of a prefill result's processing: under `prefill_free_group: grouped`
        (0.5.23) its frees are gathered into one, else each goes to the allocator at once."""
        return self.memory.free_group() if self.prefill_free_group else nullcontext()

    def process_prefill_result(self, batch: ScheduleBatch) -> None:
        with self.prefill_result_frees():
            self._process_prefill_result(batch)

    def _process_prefill_result(self, batch: ScheduleBatch) -> None:
        keep = []
        memory = self.memory
        for i, req in enumerate(batch.reqs):
            memory.commit(req, len(req.fill_ids))
            if req is self.chunked_req:
                if self.defer_chunk_caching:
                    self.chunk_to_cache = req
                else:
                    memory.cache_unfinished(req, chunked=True)
                continue
            req.output_ids.append(self.next_output_token())
            if len(req.output_ids) >= req.max_new_tokens or len(req.output_ids) == req.eos_len:
                self.finish(req)
            else:
                memory.cache_unfinished(req)
                keep.append(i)
        if len(keep) < len(batch.reqs):
            self.gate.shrank()
        batch.filter_batch(keep)
        if batch.reqs:
            self.running.merge_batch(batch)

    # -- decode ---------------------------------------------------------------------------
    def update_running_batch(self) -> ScheduleBatch | None:
        """Retract when the next decode step does not fit (or when forced), then allocate it."""
        batch = self.running
        self.gate.decode_filtered()
        n = self.retract_every
        if n and self.stats.decode_steps % n == n - 1 and len(batch.reqs) > 1:
            self.stats.forced_retractions += 1
            self._retract()
        if not batch.check_decode_mem():
            if len(batch.reqs) > 1:
                self._retract()
            if not batch.check_decode_mem():
                self._abort_running_oom()
                return None
        else:
            self.new_token_ratio = self.decayed_token_ratio(self.new_token_ratio)
        batch.prepare_for_decode()
        if self.record_batches:
            n = batch.batch_size
            self._step_batch = StepBatch(tuple(r.rid for r in batch.reqs), (0,) * n, (1,) * n)
        self.stats.decode_steps += 1
        self.stats.allocations += 1
        self.stats.allocated_tokens += batch.batch_size
        self._event("alloc", "", batch.batch_size)
        return batch

    def _retract(self) -> None:
        release = None if self.overlap is None else (lambda req: self.overlap.release(req, Release.RETRACTED))
        retracted, ratio = self.running.retract_decode(self.cfg.retract_decode_steps, self.retract_keep_victim_order,
                                                       release)
        self.gate.shrank()
        self.new_token_ratio = ratio
        self.stats.retractions += 1
        self.stats.retracted_requests += len(retracted)
        for req in retracted:
            self._event("retract", req.rid, req.seqlen)
            if self.on_admission is not None:
                self.on_admission(req, False)
        if self.retract_to_front:
            # Retracted requests were admitted before anything still waiting: they go first.
            self.waiting[:0] = sorted(retracted, key=lambda r: r.arrival_ms)
        else:
            self.waiting.extend(retracted)  # SGLang: back of the queue, in retraction order

    def _abort_running_oom(self) -> None:
        self.stats.oom_events += 1
        for req in self.running.reqs:
            self._event("oom", req.rid, req.seqlen)
            req.aborted = True
            self.finish(req)
        self.running.filter_batch()

    def process_decode_result(self, batch: ScheduleBatch) -> None:
        base, self.next_token = self.next_token, self.next_token + batch.batch_size
        memory = self.memory
        reqs = batch.reqs
        memory.commit_one_more(reqs)  # each request's own commit comes before its finish, as before
        done = []
        for token, req in enumerate(reqs, base):
            out = req.output_ids
            out.append(token)
            if len(out) >= req.max_new_tokens or len(out) == req.eos_len:
                done.append(req)
        with memory.free_group():
            for req in done:
                self.finish(req)
        if done:
            self.gate.finished_in_decode(len(done))
            batch.filter_batch()

    def finish(self, req: Req) -> None:
        req.finished = True
        self.finish_count += 1
        req.finish_ms = self.clock_ms
        why = Release.ABORTED if req.aborted else Release.FINISHED
        if self.overlap is not None:
            self.overlap.release(req, why)
        else:
            self.memory.release(req, why)
        if req.aborted:
            self.stats.aborted += 1
            self._event("abort", req.rid, req.seqlen)
        else:
            self.stats.finished += 1
            self._event("finish", req.rid, req.seqlen)
        self.finished.append(req)

    def abort(self, rid: str) -> bool:
        """Abort a request wherever it is; returns False when unknown or already done."""
        for queue in (self.waiting, self.pending):
            for req in list(queue):
                if req.rid == rid:
                    queue.remove(req)
                    self._abort_waiting(req)
                    return True
        if self.chunked_req is not None and self.chunked_req.rid == rid:
            req, self.chunked_req = self.chunked_req, None
            if self.chunk_to_cache is req:
                self.chunk_to_cache = None
            req.aborted = True
            self.finish(req)
            return True
        launched = self.overlap.unmerged_reqs() if self.overlap is not None else []
        for req in [*self.running.reqs, *launched]:
            if req.rid == rid and not req.finished:
                req.aborted = True
                self.finish(req)
                self.running.filter_batch()
                return True
        return False

    # -- cost model -----------------------------------------------------------------------
    def prefill_cost_ms(self, batch: ScheduleBatch) -> float:
        """Compute, or the load-backs it waits for when they end later (layer by layer, the
        forward overlaps them), plus any wait for write-backs its evictions started."""
        kv_read = 0 if batch.extend_plan is None else batch.extend_plan.prefix_num_tokens
        compute = (self.sim.step_base_ms + self.sim.prefill_token_us * batch.extend_num_tokens / 1e3
                   + self.sim.kv_read_ns * kv_read / 1e6)
        load_end = getattr(batch, "load_end_ms", None)
        if load_end is not None and load_end - self.clock_ms > compute:
            self.memory.record_load_wait(load_end - self.clock_ms - compute)
            compute = load_end - self.clock_ms
        return compute + self.memory.take_transfer_stall_ms()

    def decayed_token_ratio(self, ratio: float) -> float:
        """The new-token ratio one decode step after `ratio`."""
        return max(ratio - self.new_token_ratio_decay, self.min_new_token_ratio)

    def decode_cost_ms(self, batch: ScheduleBatch) -> float:
        return self.decode_step_ms(batch.batch_size, batch.seq_lens_sum())

    def decode_step_ms(self, batch_size: int, kv_read: int) -> float:
        """A decode step of `batch_size` requests reading `kv_read` tokens of KV, plus any
        wait for write-backs its evictions started."""
        return (self.sim.step_base_ms + self.sim.decode_req_us * batch_size / 1e3
                + self.sim.kv_read_ns * kv_read / 1e6 + self.memory.take_transfer_stall_ms())
