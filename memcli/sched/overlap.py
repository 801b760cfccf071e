"""SGLang's overlap loop (`event_loop_overlap`): batch N+1 is launched before batch N's result.

One `OverlapLoop.iterate()` is one iteration of SGLang 0.5.5's overlap loop:

    get_next_batch_to_run()   the chunk of last step enters the tree; the last (prefill)
                              batch, less its chunked request, joins the running batch; a
                              prefill batch, else the decode update (filter the finished,
                              retract, allocate)
    launch it                 the clock advances, its tokens are drawn; it joins the queue
    process the last result   of the batch launched one iteration earlier: tokens appended,
                              finishes released, the tree updated
    (neither a batch nor a last batch: the idle self-check)

What the one-iteration lag does to memory, and how memcli keeps its request fields true:

* A request's outputs lag its KV by one step while its last batch is in flight, so SGLang's
  decode page estimate counts `seqlen % ps == 0` (`ScheduleBatch.estimated_decode_pages`).
* A request finishes (or is retracted) while a batch that gave it one more slot is in
  flight. SGLang frees `origin + max(len(output) - 1, 0)` positions then, and that extra
  slot when the in-flight batch's result is processed; with ps > 1 only when the slot opened
  a page of its own (else its page went with the request's last page). `release` has memory
  release what SGLang frees (`MemoryManager.release_lagging`) and keeps the extra slot on the
  in-flight batch as an `InFlightSlot` (what the integrity checks count), freed exactly once
  at that batch's result.
* Finished requests leave the running batch at the next decode update, so their row and
  admission slot count until then (the admission gate needs no `lagging` count).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from memcli.mem_cache.manager import InFlightSlot, Release
from memcli.sched.batch import ScheduleBatch
from memcli.sched.req import Req


@dataclass
class InFlight:
    """What `process_batch_result` needs of a launched batch (SGLang's `batch.copy()`).

    `seq_lens` are the lengths after the batch (prefill: the fill; decode: the slot + 1);
    `tokens[i]` is request i's sampled token, None for a chunk that is not the last (a
    decode batch's tokens are consecutive: a `range`).
    `extra` maps a request released while this batch was in flight to its extra slot
    (None: freed with the request's last page)."""

    kind: str  # prefill, decode
    reqs: list
    seq_lens: list[int]
    tokens: Sequence[Optional[int]]
    extra: dict = field(default_factory=dict)


class OverlapLoop:
    """The overlap iteration over a `Scheduler`'s state (queues, running batch, gate, clock)."""

    def __init__(self, sched):
        self.sched = sched
        self.result_queue: deque[InFlight] = deque()
        self.last_batch: Optional[ScheduleBatch] = None  # launched last iteration
        self.last_kind: Optional[str] = None

    # -- state --------------------------------------------------------------------------------
    def busy(self) -> bool:
        """A batch is in flight, or its result still has to be processed."""
        return bool(self.result_queue) or self.last_batch is not None

    def unmerged_reqs(self) -> list[Req]:
        """Requests of the last prefill batch: they join the running batch next iteration."""
        if self.last_batch is None or self.last_kind != "prefill":
            return []
        return list(self.last_batch.reqs)

    def in_flight_slots(self) -> list[InFlightSlot]:
        return [slot for flight in self.result_queue for slot in flight.extra.values() if slot is not None]

    def in_flight_count(self) -> int:
        """`len(in_flight_slots())`, without building the list when nothing is held."""
        return sum(slot is not None for flight in self.result_queue if flight.extra for slot in flight.extra.values())

    # -- one iteration ------------------------------------------------------------------------
    def iterate(self) -> tuple[str, int, int]:
        """One loop iteration; returns (kind, batch size, new tokens) of the launched batch."""
        s = self.sched
        s.admit_arrivals()
        kind, batch = self.get_next_batch_to_run()
        if batch is not None:
            self._launch(kind, batch)
        if self.last_batch is not None:
            self._process(self.result_queue.popleft())
            if batch is None:
                s.stats.idle_steps += 1  # no batch, but no idle check either: a result was pending
        elif batch is None:
            s.idle()
        self.last_batch, self.last_kind = batch, kind
        if batch is None:
            return "idle", 0, 0
        return kind, batch.batch_size, batch.extend_num_tokens if kind == "prefill" else batch.batch_size

    def get_next_batch_to_run(self) -> tuple[Optional[str], Optional[ScheduleBatch]]:
        s = self.sched
        s.cache_deferred_chunk(give_back_row=s.chunk_gives_back_row)
        last = self.last_batch
        if last is not None and self.last_kind == "prefill":
            keep = [i for i, r in enumerate(last.reqs) if not r.finished and r is not s.chunked_req]
            if len(keep) < len(last.reqs):
                s.gate.shrank()
            last.filter_batch(keep)
            if last.reqs:
                s.running.merge_batch(last)
        if s.gate.relaxed:  # 0.5.23 filters the running batch every step: finished requests leave now
            before = len(s.running.reqs)
            s.filter_running()
            if len(s.running.reqs) < before:
                s.gate.shrank()
        batch = s.get_new_batch_prefill()
        if batch is not None:
            return "prefill", batch
        if not s.running.reqs:
            return None, None
        return self.update_running_batch()

    def update_running_batch(self) -> tuple[Optional[str], Optional[ScheduleBatch]]:
        """Filter the finished out (they finished in the last result), then SGLang's decode
        update. With `skip_finishing_decode`, the requests the batch in flight finishes by
        length leave the batch first, and a decode that does not fit while any did is skipped
        (no retraction)."""
        s = self.sched
        before = len(s.running.reqs)
        if not s.gate.relaxed:
            # Under the relaxed gate `get_next_batch_to_run` filtered the batch this iteration,
            # and a prefill attempt finishes no running request: nothing is left to filter.
            s.filter_running()
        finishing = self._finishing_in_flight() if s.skip_finishing_decode else set()
        if finishing:
            s.running.filter_batch([i for i, r in enumerate(s.running.reqs) if r not in finishing])
        if len(s.running.reqs) < before:
            s.gate.shrank()
        if not s.running.reqs:
            return None, None
        if finishing and not s.running.check_decode_mem():
            return None, None
        decoded = s.update_running_batch()
        return ("decode", decoded) if decoded is not None else (None, None)

    def _finishing_in_flight(self) -> set:
        """Requests of the batch in flight whose result gives them their last output."""
        if not self.result_queue:
            return set()
        # The running requests of the batch in flight that one more token finishes. Tested
        # over the batch in flight, not the running batch: the same set, and after a prefill
        # step the batch in flight is a few requests where the running batch is all of them.
        ending = [r for r in self.result_queue[0].reqs if len(r.output_ids) + 1 >= r.max_new_tokens]
        if not ending:
            return set()
        running = set(self.sched.running.reqs)
        return {r for r in ending if r in running}

    def _launch(self, kind: str, batch: ScheduleBatch) -> None:
        s = self.sched
        if kind == "prefill":
            s.clock_ms += s.prefill_cost_ms(batch)
            chunked = s.chunked_req
            if chunked is not None and chunked in batch.reqs:
                s.chunk_to_cache = chunked  # enters the tree at the start of the next iteration
            tokens = [None if r is chunked else s.next_output_token() for r in batch.reqs]
        else:
            s.clock_ms += s.decode_cost_ms(batch)
            base = s.next_token
            s.next_token += batch.batch_size
            tokens = range(base, base + batch.batch_size)  # read once, in order: no list needed
        self.result_queue.append(InFlight(kind, list(batch.reqs), batch.seq_lens_cpu.tolist(), tokens))

    # -- results ------------------------------------------------------------------------------
    def _process(self, flight: InFlight) -> None:
        if flight.kind == "prefill":
            with self.sched.prefill_result_frees():
                self._process_prefill(flight)
        else:
            with self.sched.memory.free_group():
                self._process_decode(flight)

    def _skip(self, flight: InFlight, req: Req) -> bool:
        """Released while in flight: free its extra slot (once), take no token."""
        if req in flight.extra:
            slot = flight.extra.pop(req)
            if slot is not None:
                self.sched.memory.free_in_flight([slot.slot])
            return True
        return req.finished or req.is_retracted

    def _process_prefill(self, flight: InFlight) -> None:
        s = self.sched
        for req, seq_len, token in zip(flight.reqs, flight.seq_lens, flight.tokens):
            if self._skip(flight, req):
                continue
            s.memory.commit(req, seq_len)
            if token is None:
                continue  # a chunk: it entered the tree at the start of this iteration
            req.output_ids.append(token)
            if len(req.output_ids) >= req.max_new_tokens or len(req.output_ids) == req.eos_len:
                s.finish(req)
            else:
                s.memory.cache_unfinished(req)

    def _process_decode(self, flight: InFlight) -> None:
        # The per-request loop of every decode result, kept to the token and the finish test:
        # `_skip`'s test inlined (a request with an extra slot is skipped whatever its state),
        # the commits made in one call after it, the finishes after them (each one's own
        # request only: the order of what memory sees per request is the plain loop's).
        s = self.sched
        extra = flight.extra
        done, skipped = [], []
        for req, token in zip(flight.reqs, flight.tokens):
            if extra and req in extra:
                self._skip(flight, req)
                skipped.append(req)
                continue
            if req.finished or req.is_retracted:
                skipped.append(req)
                continue
            out = req.output_ids
            out.append(token)
            n = len(out)
            if n >= req.max_new_tokens or n == req.eos_len:
                done.append(req)
        if skipped:
            gone = set(map(id, skipped))
            pairs = [(r, n) for r, n in zip(flight.reqs, flight.seq_lens) if id(r) not in gone]
            s.memory.commit_each([r for r, _ in pairs], [n for _, n in pairs])
        else:
            s.memory.commit_each(flight.reqs, flight.seq_lens)
        for req in done:
            s.finish(req)

    # -- releasing a request ------------------------------------------------------------------
    def release(self, req: Req, why: Release) -> None:
        """Release `req` as SGLang does under overlap: its first `origin + max(len(output) - 1,
        0)` positions now; a slot beyond them (allocated by a batch still in flight) when that
        batch's result is processed, and only if no freed page holds it."""
        if self.sched.release_committed:  # 0.5.23: the slot in flight goes with the row, now
            if self.sched.eos_extra_insert and why is Release.FINISHED:
                # committed at allocation: an EOS finish (decoded once more, in flight) inserts
                # min(committed, input + output) tokens, one more than 0.5.5 (issue #24590)
                self.sched.memory.commit(req, min(req.kv_allocated_len, req.input_len + len(req.output_ids)))
            self.sched.memory.release(req, why)
            return
        kv_len = min(req.kv_allocated_len, req.input_len + max(len(req.output_ids) - 1, 0))
        released = self.sched.memory.release_lagging(req, kv_len, why)
        if released.extra:
            self._flight_holding(req).extra[req] = released.slot

    def _flight_holding(self, req: Req) -> InFlight:
        """The newest in-flight batch with `req`: the one that allocated its extra slot."""
        for flight in reversed(self.result_queue):
            if req in flight.reqs:
                return flight
        raise AssertionError(f"request {req.rid} holds a slot beyond its KV but no batch in flight has it")
