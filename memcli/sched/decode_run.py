"""Steady decode runs of the overlap loop, taken in one go (the replay's fast path).

An iteration of `OverlapLoop.iterate` is *steady* when all it does is lengthen the running
batch by one token: the batch in flight is a decode of exactly the running requests, none of
which finishes with its result or the next; no request arrives; the admission gate tries no
prefill; no chunk is pending; memory has the slots without evicting. A run of steady
iterations is then fixed in advance, and `DecodeRuns.take` applies it at once:

    memory      the run's slots, step after step from the free list's head, written into
                the rows at the lengths each step had (one copy), every record that much
                longer (`MemoryManager.alloc_decode_run`)
    results     the outputs the plain loop draws (the batch in flight, then each step's),
                the commits of the last result processed, the run's last batch in flight
    scheduler   the clock and the new-token ratio advanced step by step, by the same float
                operations; the counters; one step record per step, each handed to
                `on_step`, as the plain loop records it

so that everything the plain loop leaves (tree, free list, rows, requests, records, the
batch in flight) is the same. What a run needs of the stack, and the configurations it
leaves to the plain loop (the full walk every step, forced retractions, the triton backend, a
host tier with a copy ending or a write-back wait to pay), are in `steady` and
`MemoryManager.decode_run_steps`. Under the incremental check (`--check`) the ledger is told
each step of a run under its own number, and one check after the run covers what all its
steps changed (`IntegrityChecker.after_run`).
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from memcli.mem_cache.manager import Usage
from memcli.sched.overlap import InFlight
from memcli.steps import Event, StepBatch, StepRecord

_finished = attrgetter("finished")
MIN_RUN = 2  # a run of one step is the plain loop's step


class DecodeRuns:
    """The fast path of one overlap-loop scheduler."""

    def __init__(self, sched):
        self.sched = sched

    def steady(self, limit: int) -> int:
        """How many of the next iterations are steady, at most `limit` (0: the next one is
        not, or fewer than two are). The arrivals are `take`'s to bound."""
        s = self.sched
        loop = s.overlap
        if loop is None or loop.last_kind != "decode" or len(loop.result_queue) != 1 or s.chunked_req is not None \
                or s.chunk_to_cache is not None or s.retract_every or not s.checker.checks_runs:
            return 0
        # A host tier: no write-back wait to pay, and (acknowledged every step) no copy ending now.
        if s.hierarchical and s.memory.host_quiet_until() <= (s.clock_ms if s.ack_every_step else 0.0):
            return 0
        flight, batch = loop.result_queue[0], s.running
        reqs = batch.reqs
        if flight.kind != "decode" or flight.extra or loop.last_batch is not batch or flight.reqs != reqs \
                or not s.gate.quiet(bool(s.waiting), False) \
                or (s.running_may_hold_finished() and any(map(_finished, reqs))) \
                or (s.pending and s.pending[0].arrival_ms <= s.clock_ms):
            return 0
        # Here every running request's row holds its prompt and all its outputs but the one in
        # flight (its length in `seq_lens_cpu` is `input_len + len(output_ids)`), so its results
        # to go before it finishes are `decode_ends - seq_lens_cpu`, and SGLang's overlap page
        # estimate (which reads `input_len + len(output_ids)`) counts the exact pages.
        room = int((batch.decode_ends() - batch.seq_lens_cpu.numpy()).min())
        if min(room, limit) < MIN_RUN:
            return 0
        steps = s.memory.decode_run_steps(batch.seq_lens_cpu, min(room, limit))
        return steps if steps >= MIN_RUN else 0

    def take(self, steps: int, until_ms: float) -> int:
        """Apply the next `steps` steady iterations (`steady`), stopping after the first step
        whose clock reaches `until_ms` (the next arrival): the plain loop would hand that
        request in before the next step. Returns the steps taken."""
        s = self.sched
        loop, batch, memory = s.overlap, s.running, s.memory
        flight, reqs = loop.result_queue[0], batch.reqs
        bs = len(reqs)
        if s.pending:  # added, not yet arrived: admitted by the first iteration the clock reaches it
            until_ms = min(until_ms, s.pending[0].arrival_ms)
        if s.hierarchical and s.ack_every_step:  # a copy ending: acknowledged at the next step's start
            until_ms = min(until_ms, memory.host_quiet_until())
        before = s.progress_guard.marks(s)
        clocks, clock, kv_read = [], s.clock_ms, batch.seq_lens_sum()
        while len(clocks) < steps and (not clocks or clock < until_ms):
            kv_read += bs
            clock += s.decode_step_ms(bs, kv_read)
            clocks.append(clock)
        steps = len(clocks)
        held, start = s._held_tokens(), memory.usage()
        taken = (memory.page_size * np.cumsum(batch.decode_run(steps))).tolist()  # the slots taken after each step
        self._results(flight, reqs, steps)
        for _ in range(steps):
            s.new_token_ratio = s.decayed_token_ratio(s.new_token_ratio)
        stats = s.stats
        stats.decode_steps += steps
        stats.allocations += steps
        stats.allocated_tokens += steps * bs
        first = s.step_count
        self._records(clocks, bs, held, start, taken)
        s.progress_guard.after_step(s, before)
        s.stats.checks_run += s.checker.after_run(first, steps, s.memory_holders())
        return steps

    def _results(self, flight: InFlight, reqs: list, steps: int) -> None:
        """The results the run processes (the batch in flight, then each step's but the last)
        and the last step's batch, now in flight."""
        s, bs = self.sched, len(reqs)
        base = flight.tokens.start  # the tokens of a decode step are consecutive, in batch order
        for i, req in enumerate(reqs, base):
            req.output_ids.extend(range(i, i + steps * bs, bs))
        s.memory.commit_each(reqs, [n + steps - 1 for n in flight.seq_lens])
        last = base + steps * bs
        s.next_token = last + bs
        s.overlap.result_queue[0] = InFlight("decode", list(reqs), s.running.seq_lens_cpu.tolist(),
                                             range(last, last + bs))

    def _records(self, clocks: list, bs: int, held: int, start: Usage, taken: list) -> None:
        """One record per step, as `Scheduler._record` makes it (with the step's batch and
        its allocation event when those are recorded), handed to `on_step`."""
        s = self.sched
        memory, waiting = s.memory, len(s.waiting)
        evictable, protected = start.evictable, start.protected
        host = memory.host_tier()  # no copy is issued in a run: the host pool and its bytes stay
        host_used = 0 if host is None else host.used
        batch = StepBatch(tuple(r.rid for r in s.running.reqs), (0,) * bs, (1,) * bs) if s.record_batches else None
        for j, clock in enumerate(clocks, 1):
            if s.record_events:  # the allocation comes before the launch moves the clock
                s.events.append(Event(s.step_count, s.clock_ms, "alloc", "", bs))
            s.clock_ms = clock
            usage = Usage(start.available - taken[j - 1], evictable, protected)
            record = StepRecord(s.step_count, clock, "decode", bs, bs, bs, waiting, usage.available, evictable,
                                protected, held + j * bs, memory.held_pages(usage), host_used, batch=batch)
            s.records.append(record)
            s.step_count += 1
            if s.on_step is not None:
                s.on_step(s, record)
