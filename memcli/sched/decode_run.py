"""Steady decode runs of the overlap loop, taken in one go (the replay's fast path).

An iteration of `OverlapLoop.iterate` is *steady* when all it does is lengthen the running
batch by one token: the batch in flight is a decode of exactly the running requests; no
request arrives; the admission gate tries no prefill; no chunk is pending; memory has the
slots without evicting. A run of steady iterations is then fixed in advance, and
`DecodeRuns.take` applies it at once:

    memory      the run's slots, step after step from the free list's head, written into
                the rows at the lengths each step had (one copy per stretch of steps with the
                same batch), every record that much longer (`MemoryManager.alloc_decode_run`)
    results     the outputs the plain loop draws (the batch in flight, then each step's),
                the commits of the last result processed, the run's last batch in flight
    scheduler   the clock and the new-token ratio advanced step by step, by the same float
                operations; the counters; one step record per step, each handed to
                `on_step`, as the plain loop records it

so that everything the plain loop leaves (tree, free list, rows, requests, records, the
batch in flight) is the same.

Requests that finish by length may finish inside a run (`finishes_absorbed`: SGLang 0.5.23's
overlap loop with nothing waiting, no host tier and no KV events). At the iteration
a request's last token comes back, the plain loop takes it out of the batch before the step's
allocation and releases it once that step is launched; a run does the same at that
iteration: the batch loses it, the step is allocated, its outputs and commit are written and
it is released (`Scheduler.finish`), in one free group, before the step's record. A request
that finishes by EOS ends the run before its last iteration, as does an arrival.

What a run needs of the stack, and the configurations it leaves to the plain loop (the full
walk every step, forced retractions, the triton backend, a host tier with a copy ending or a
write-back wait to pay), are in `steady` and `MemoryManager.decode_run_steps`. Under the
incremental check (`--check`) the ledger is told each step of a run under its own number,
and one check after the run covers what all its steps changed (`IntegrityChecker.after_run`).
"""

from __future__ import annotations

import functools
import itertools
from array import array
from operator import attrgetter

import numpy as np

from memcli.mem_cache.manager import Usage
from memcli.sched.overlap import InFlight
from memcli.steps import Event, StepBatch, StepRecord, StepRun

_finished = attrgetter("finished")
_outputs = attrgetter("output_ids")
_max_new = attrgetter("max_new_tokens")
MIN_RUN = 2  # a run of one step is the plain loop's step


class DecodeRuns:
    """The fast path of one overlap-loop scheduler."""

    def __init__(self, sched):
        self.sched = sched
        # The run `steady` found: per request of the running batch, the iteration (1-based) at
        # which it finishes inside the run, 0 for none (None: no request does).
        self._leave_at: np.ndarray | None = None

    def finishes_absorbed(self) -> bool:
        """Whether requests may finish inside a run: SGLang 0.5.23's overlap loop (the
        requests a result finishes leave the batch before the step's allocation, and take
        their slot in flight with them), nothing waiting (a finish would let the gate try a
        prefill), no host tier (a release starts copies) and no KV events (stamped when the
        run ends)."""
        s = self.sched
        return (s.release_committed and s.skip_finishing_decode and s.gate.relaxed and not s.waiting
                and not s.hierarchical and not getattr(s.memory.tree_cache, "kv_events", False))

    def steady(self, limit: int) -> int:
        """How many of the next iterations are steady, at most `limit` (0: the next one is
        not, or fewer than two are). The arrivals are `take`'s to bound."""
        s = self.sched
        loop = s.overlap
        self._leave_at = None
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
        rooms = batch.decode_ends() - batch.seq_lens_cpu.numpy()
        room, leave_at = int(rooms.min()), None
        if room < limit and self.finishes_absorbed():
            room, leave_at = self._finishes(reqs, rooms, limit)
        if min(room, limit) < MIN_RUN:
            return 0
        steps = s.memory.decode_run_steps(batch.seq_lens_cpu, min(room, limit))
        if steps < MIN_RUN:
            return 0
        if leave_at is not None:
            leave_at[leave_at > steps] = 0
            self._leave_at = leave_at if leave_at.any() else None
        return steps

    @staticmethod
    def _finishes(reqs: list, rooms: np.ndarray, limit: int) -> tuple[int, np.ndarray]:
        """The iterations a run may take when requests finish inside it, and the iteration at
        which each does (0: none): a request whose last token is its `max_new_tokens`-th
        leaves at iteration `room + 1` (the one whose result brings that token); one that
        ends on EOS bounds the run before its last iteration, and the batch is never left
        empty."""
        n = len(reqs)
        max_new = np.fromiter(map(_max_new, reqs), np.int64, n)
        outputs = np.fromiter(map(len, map(_outputs, reqs)), np.int64, n)
        leave_at = rooms + 1
        by_length = outputs + leave_at == max_new  # the finishing iteration is the length's
        if by_length.all():
            bound = int(leave_at.max()) - 1  # the last of them would leave the batch empty
        else:
            bound = int(rooms[~by_length].min())  # an EOS ends the run before its iteration
        bound = min(bound, limit)
        return bound, np.where(by_length & (leave_at <= bound), leave_at, 0)

    def take(self, steps: int, until_ms: float) -> int:
        """Apply the next `steps` steady iterations (`steady`), stopping after the first step
        whose clock reaches `until_ms` (the next arrival): the plain loop would hand that
        request in before the next step. Returns the steps taken."""
        s = self.sched
        loop, batch, memory = s.overlap, s.running, s.memory
        flight = loop.result_queue[0]
        leave_at, self._leave_at = self._leave_at, None
        if s.pending:  # added, not yet arrived: admitted by the first iteration the clock reaches it
            until_ms = min(until_ms, s.pending[0].arrival_ms)
        if s.hierarchical and s.ack_every_step:  # a copy ending: acknowledged at the next step's start
            until_ms = min(until_ms, memory.host_quiet_until())
        before = s.progress_guard.marks(s)
        first_reqs = batch.reqs
        clocks = self._clocks(steps, until_ms, leave_at)
        steps = len(clocks)
        boundaries = [] if leave_at is None else sorted(set(leave_at[(leave_at > 0) & (leave_at <= steps)].tolist()))
        first = s.step_count
        run = _Launches(first_reqs, flight.tokens.start)
        held = s._held_tokens()
        starts = [1, *boundaries] if not boundaries or boundaries[0] != 1 else boundaries
        taken = lengths = paged = None
        ps = memory.page_size
        if boundaries and memory.allocator.ledger is None:
            # The batch losing its requests as they leave, its slots are taken in as few
            # allocations as the free list allows (then `_segment` takes none, and the length
            # tensors are filtered and moved on at the end). Page size 1: frees go to the free
            # list's tail, behind the run's slots: every step's at once. Paged, frees go back
            # in front: the run is planned at once, and its pages taken up to and including
            # each iteration where requests leave (before their release), the next right
            # after that release; a leaving request's row is written before its release reads
            # it, the others' when the run ends.
            self._available = memory.usage()
            lengths = batch.seq_lens_cpu.numpy()
            if ps == 1:
                taken = batch.decode_run_leaving(steps, leave_at).tolist()
            else:
                paged = batch.paged_run_leaving(steps, leave_at)
                taken = (ps * paged.opened).tolist()
                paged.take(boundaries[0])
        ends = [*boundaries[1:], steps]
        for a, b in zip(starts, [*starts[1:], steps + 1]):
            gone = committed = then = None
            if a in boundaries:
                leaving = np.flatnonzero(leave_at == a)
                gone = [first_reqs[i] for i in leaving.tolist()]
                if lengths is not None:  # their lengths when they leave: the run's start's, `a - 1` on
                    committed = (lengths[leaving] + (a - 1)).tolist()
                    nxt = ends[boundaries.index(a)]
                    if paged is not None:
                        paged.write(leaving, a - 1)
                        if nxt > a:
                            then = functools.partial(paged.take, nxt)
            held = self._segment(clocks[a - 1 : b - 1], gone, run, held, a - 1,
                                 None if taken is None else taken[a - 1 : b - 1], committed, then)
        if taken is not None:
            staying = np.flatnonzero((leave_at == 0) | (leave_at > steps))
            if paged is not None:
                paged.write(staying, steps)
            batch.advance(steps, staying)
        memory.grow_records(batch.reqs, steps)
        self._results(run)
        for _ in range(steps):
            s.new_token_ratio = s.decayed_token_ratio(s.new_token_ratio)
        stats = s.stats
        stats.decode_steps += steps
        stats.allocations += steps
        stats.allocated_tokens += run.allocated
        if boundaries and boundaries[-1] < steps:  # a later step's filter found the batch clean
            s._running_clean_at = s.finish_count
        s.progress_guard.after_step(s, before)
        s.stats.checks_run += s.checker.after_run(first, steps, s.memory_holders())
        return steps

    def _clocks(self, steps: int, until_ms: float, leave_at: np.ndarray | None) -> list:
        """The clock after each iteration's launch, up to the first that reaches `until_ms`:
        each step's batch reads the KV of the requests still in it, one token longer."""
        s, batch = self.sched, self.sched.running
        clocks, clock, kv_read, bs = [], s.clock_ms, batch.seq_lens_sum(), len(batch.reqs)
        leavers = read = None
        if leave_at is not None:  # per iteration, the requests that leave and the KV they read
            gone = leave_at > 0
            leavers = np.bincount(leave_at[gone], minlength=steps + 1).tolist()
            lengths = np.zeros(steps + 1, dtype=np.int64)
            np.add.at(lengths, leave_at[gone], batch.seq_lens_cpu.numpy()[gone])
            read = lengths.tolist()
        while len(clocks) < steps and (not clocks or clock < until_ms):
            j = len(clocks) + 1
            if leavers is not None and leavers[j]:  # they read their KV up to the last step
                bs -= leavers[j]
                kv_read -= read[j] + leavers[j] * (j - 1)
            kv_read += bs
            clock += s.decode_step_ms(bs, kv_read)
            clocks.append(clock)
        return clocks

    def _segment(self, clocks: list, gone: list | None, run: "_Launches", held: int, done: int,
                 taken: list | None = None, committed: list | None = None, then=None) -> int:
        """The iterations from one where requests finish (`gone`; None: the run's first) up to
        the next: `gone` leave the batch before the first one's allocation and are released
        once it is launched, after their last outputs and commits, in one free group; then a
        record per iteration. With page size 1 the segment's slots are taken at once (frees go
        to the free list's tail, behind them); paged, or with a ledger (told every operation
        under its step's number), the first step's before the release and the rest after it
        (freed pages go back in front). `taken`: the slots of each of its iterations were taken
        with the whole run's (`take`), before any release, and `gone` leave the request list
        only (the length tensors are filtered when the run ends): `committed` are their
        lengths, and `then` (paged) takes the next iterations' slots once they are released.
        The records of the requests that stay grow when the run ends (`take`); those of
        `gone` here, by the run's `done` steps."""
        s, batch, memory = self.sched, self.sched.running, self.sched.memory
        ps, ledger = memory.page_size, memory.allocator.ledger
        owned = 0
        if gone is not None:
            reqs = batch.reqs
            at = [reqs.index(r) for r in gone]  # batch order: each after the one before
            if committed is None:
                lengths = batch.seq_lens_cpu.tolist()
                committed = [lengths[i] for i in at]
            memory.grow_records(gone, done)
            owned = sum(r.kv.kv_allocated_len - r.kv.last_matched_prefix_len for r in gone)
            batch.drop(at, lengths=taken is None)
            s.gate.shrank()
        n, bs = len(clocks), len(batch.reqs)
        at_once = gone is None or (ps == 1 and ledger is None) or taken is not None
        if ledger is not None:  # the allocation's first step is this iteration
            ledger.step = s.step_count
        if taken is None:
            start = memory.usage()
            taken = (ps * np.cumsum(batch.decode_run(n if at_once else 1, grow_records=False))).tolist()
        else:  # taken with the run's: the free list as this segment's own call would have left it
            start, taken = self._available, list(itertools.accumulate(taken))
        run.launched(batch.reqs, len(taken), () if gone is None else at)
        evictable, protected = start.evictable, start.protected
        available = [start.available - t for t in taken]
        if gone is not None:
            if s.record_events:  # the allocation comes before the launch moves the clock
                s.events.append(Event(s.step_count, s.clock_ms, "alloc", "", bs))
            s.clock_ms = clocks[0]
            before = memory.allocator.available_size()
            with memory.free_group():
                for req, kv_len, i in zip(gone, committed, at):
                    req.output_ids.extend(run.outputs_of(i))
                    memory.commit(req, kv_len)
                for req in gone:
                    s.finish(req)
            after = memory.usage()
            freed = after.available - before
            available = [a + freed for a in available]
            evictable, protected = after.evictable, after.protected
            if then is not None:
                then()
            if not at_once and n > 1:
                if ledger is not None:
                    ledger.step = s.step_count + 1  # the rest's first step is the next iteration
                rest = (ps * np.cumsum(batch.decode_run(n - 1, grow_records=False))).tolist()
                run.launched(batch.reqs, n - 1)
                available += [available[0] - t for t in rest]
        self._available = Usage(available[-1], evictable, protected)  # where the next segment starts
        n = min(len(clocks), len(available))
        if s.on_steps is not None and n:  # the records as columns, handed over at once
            held += bs - owned
            self._record_run(clocks[:n], bs, [held + j * bs for j in range(n)], available[:n], evictable, protected)
            return held + (n - 1) * bs
        for j, (clock, free) in enumerate(zip(clocks, available)):
            held += bs - (owned if j == 0 else 0)
            self._record(clock, bs, held, Usage(free, evictable, protected), alloc_event=j > 0 or gone is None)
        return held

    def _record_run(self, clocks: list, bs: int, held: list, available: list, evictable: int, protected: int) -> None:
        """The records of consecutive steps of `bs` requests (`clocks`, `held`, `available`:
        one per step) as one `StepRun` to `on_steps`: the same fields `_record` gives each;
        `records` gets the last step's."""
        s, memory = self.sched, self.sched.memory
        host = memory.host_tier()
        run = StepRun(s.step_count, clocks, bs, len(s.waiting), available, evictable, protected, held,
                      memory.held_pages_each(available, evictable), 0 if host is None else host.used)
        s.clock_ms = clocks[-1]
        s.step_count += len(clocks)
        s.records.append(run.last())
        s.on_steps(s, run)

    def _record(self, clock: float, bs: int, held: int, usage: Usage, alloc_event: bool = True) -> None:
        """The step's record, as `Scheduler._record` makes it (with the step's batch and its
        allocation event when those are recorded), handed to `on_step`."""
        s, memory = self.sched, self.sched.memory
        if alloc_event and s.record_events:  # the allocation comes before the launch moves the clock
            s.events.append(Event(s.step_count, s.clock_ms, "alloc", "", bs))
        s.clock_ms = clock
        host = memory.host_tier()  # no copy is issued in a run: the host pool and its bytes stay
        batch = StepBatch(tuple(r.rid for r in s.running.reqs), (0,) * bs, (1,) * bs) if s.record_batches else None
        record = StepRecord(s.step_count, clock, "decode", bs, bs, bs, len(s.waiting), usage.available,
                            usage.evictable, usage.protected, held, memory.held_pages(usage),
                            0 if host is None else host.used, batch=batch)
        s.records.append(record)
        s.step_count += 1
        if s.on_step is not None:
            s.on_step(s, record)

    def _results(self, run: "_Launches") -> None:
        """The results the run processed for the requests still running (the batch in flight,
        then each step's but the last), their commits, and the last step's batch, now in
        flight."""
        s, batch = self.sched, self.sched.running
        run.deliver()
        reqs, lengths = batch.reqs, batch.seq_lens_cpu.tolist()
        s.memory.commit_each(reqs, [n - 1 for n in lengths])
        last = run.last_base
        s.next_token = last + len(reqs)
        s.overlap.result_queue[0] = InFlight("decode", list(reqs), lengths, range(last, last + len(reqs)))


class _Launches:
    """The batches a run launched, with their tokens: batch `reqs` launched `count` times in a
    row draws the consecutive tokens `base + step * len(reqs) + position`. Starts with the
    batch in flight when the run begins (launched once, before it). A batch only ever loses
    requests (they finish), keeping the others' order: each entry keeps the positions, in the
    entry before it, of the requests that left in between."""

    __slots__ = ("runs", "next_base", "allocated")

    def __init__(self, reqs: list, base: int):
        self.runs = [[reqs, base, 1, ()]]
        self.next_base = base + len(reqs)
        self.allocated = 0  # slots the run's own launches allocated

    def launched(self, reqs: list, count: int, removed=()) -> None:
        """`count` launches of `reqs`: the last batch less the requests at `removed`
        (ascending), or the last batch itself."""
        last = self.runs[-1]
        if last[0] is reqs:
            last[2] += count
        else:
            self.runs.append([reqs, self.next_base, count, removed])
        self.next_base += count * len(reqs)
        self.allocated += count * len(reqs)

    @property
    def last_base(self) -> int:
        """The tokens of the last launch (in flight when the run ends) start here."""
        return self.next_base - len(self.runs[-1][0])

    def outputs_of(self, pos: int) -> list:
        """The tokens of the request that just left the batch from position `pos`, from every
        launch so far (each one processed), oldest first."""
        runs, parts = self.runs, []
        for k in range(len(runs) - 2, -1, -1):
            reqs, base, count, _ = runs[k]
            bs = len(reqs)
            parts.append(range(base + pos, base + pos + count * bs, bs))
            for r in runs[k][3]:  # its position before those requests left
                if r > pos:
                    break
                pos += 1
        out: list = []
        for part in reversed(parts):
            out.extend(part)
        return out

    def deliver(self) -> None:
        """The tokens of every launch but the last (in flight) to the requests of the last,
        launch after launch: one matrix of them, a row per request, whose bytes each
        request's output array takes (a list of outputs takes the row's ints)."""
        runs = self.runs
        final = runs[-1][0]
        width, depth = len(final), sum(run[2] for run in runs) - 1
        if not width or depth <= 0:
            return
        tokens = np.empty((width, depth), dtype=np.int64)
        cols = np.arange(width, dtype=np.int64)  # the last batch's requests, in each batch from the last back
        step = depth
        for k in range(len(runs) - 1, -1, -1):
            reqs, base, count, removed = runs[k]
            if k == len(runs) - 1:
                count -= 1
            if count > 0:
                bs = len(reqs)
                step -= count
                tokens[:, step : step + count] = (base + cols)[:, None] + bs * np.arange(count)
            for r in removed:  # their positions before those requests left
                cols += cols >= r
        data, size = memoryview(tokens.reshape(-1)).cast("B"), depth * tokens.itemsize
        for i, out in enumerate(map(_outputs, final)):
            if out.__class__ is array:
                out.frombytes(data[i * size : (i + 1) * size])
            else:
                out.extend(tokens[i].tolist())
