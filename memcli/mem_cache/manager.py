"""The memory manager: the one object the scheduler and the tools reach memory through.

It owns the request table (`req_to_token`), the KV allocator, the tree cache, the page size
and, when checking, the ownership ledger. Its verbs come in pairs of a query and an action,
with typed values in and out; it writes each request's memory record (`req.kv`, a `ReqKV`)
and nothing else of a request, and never calls back into the scheduler.

    scheduler                               MemoryManager
    requests to prefill               ->    plan_extend            -> ExtendPlan
    ExtendPlan                        ->    alloc_extend           -> ExtendAllocation | None
    pages the next decode opens       ->    can_decode             -> bool (may evict)
    the running batch's tensors       ->    alloc_decode           -> DecodeAllocation | None
    a request done with memory        ->    release(req, Release.*)
    a request whose KV was computed   ->    commit / cache_unfinished
    tokens wanted free                ->    evict                  -> tokens freed
                                            usage                  -> Usage

Extend (prefill) of request i, in its `req_to_token` row:

    [0, prefix_len)          prefix slots (`req.kv.prefix_indices`, from the tree or earlier chunks)
    [prefix_len, seq_len)    new slots, out_cache_loc[off_i : off_i + extend_len_i]

Decode: one new slot per request, written at column `seq_len` (the old length); the caller
increments its `seq_lens` afterwards.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from memcli import kernels
from memcli.errors import IntegrityError, OutOfMemoryError, RequestSlotsExhausted
from memcli.mem_cache import pages
from memcli.mem_cache.allocator import DecodeAllocation, PagedRun
from memcli.mem_cache.base_prefix_cache import RadixKey
from memcli.mem_cache.chunk_cache import free_row_pages
from memcli.mem_cache.extend_graph import BareExtend
from memcli.mem_cache.integrity.ownership import IN_FLIGHT
from memcli.mem_cache.integrity import CheckPolicy, IntegrityChecker, InFlightSlot, check_memory
from memcli.mem_cache.null_cache import NullCache
from memcli.mem_cache.req_kv import ReqKV

__all__ = ["COMPONENTS", "CheckPolicy", "DecodeAllocation", "IntegrityChecker", "ExtendAllocation", "ExtendPlan", "InFlightSlot", "MemoryManager",
           "PageSizeMismatch", "PagedRun", "Release", "ReqKV", "Usage"]


# The components of a stack that hold or read a page size (check-page-size inspects each).
COMPONENTS = ("kv_pool", "allocator", "tree_cache", "scheduler", "null_cache", "host_pool")


class PageSizeMismatch(IntegrityError):
    """The allocator and the tree cache disagree about the page size."""


class Release(enum.Enum):
    """Why a request gives its memory back: its prefix enters the tree unless retracted."""

    FINISHED = "finished"
    ABORTED = "aborted"
    RETRACTED = "retracted"

    @property
    def inserts(self) -> bool:
        return self is not Release.RETRACTED


def _prefix_in_row(kv: Any) -> int:
    """`ReqKV.prefix_in_row` of a memory record (0 for a record without a prefix store)."""
    return kv.prefix_in_row() if getattr(kv, "prefix_store", None) is not None else 0


@dataclass(frozen=True, slots=True)
class ExtendPlan:
    """What an extend batch asks of memory; built by `plan_extend`, read by `alloc_extend`.

    Frozen, and its lists and tensors are never mutated by memory (`_rows_for` copies).

    Request i extends its row from `prefix_lens_cpu[i]` to `seq_lens_cpu[i]` tokens; the
    slots of its prefix are `prefix_tensors[i]`. `num_pages` is what the batch opens
    (`pages.extend_new_pages`), counted once, on the host, from the same lengths.
    """

    rows: list[Optional[int]]  # request row per request; None: take a new row
    prefix_lens_cpu: torch.Tensor  # int64, CPU
    seq_lens_cpu: torch.Tensor  # int64, CPU
    prefix_tensors: list[torch.Tensor]  # each request's prefix_indices (int64)
    extend_num_tokens: int  # new tokens over the batch
    num_pages: int  # pages the batch opens
    prefix_num_tokens: int  # prefix tokens over the batch (the KV the extend reads)
    # The fused kernel's host plan (offsets and prefix addresses, `kernels.extend_host_plan`),
    # computed with the plan so that the memory path only copies it; None: computed there.
    host_plan: Optional[np.ndarray] = None
    # Per request, the leading prefix slots its row holds already (`ReqKV.prefix_in_row`: a
    # chunked request that kept its row), which the CPU writer does not write again; None: 0.
    kept_prefix: Optional[list[int]] = None

    @classmethod
    def build(cls, rows: list[Optional[int]], prefix_tensors: list[torch.Tensor], seq_lens: list[int],
              page_size: int, host_plan: bool = False, kept_prefix: Optional[list[int]] = None) -> "ExtendPlan":
        """The plan of requests whose rows will hold `seq_lens` tokens after their prefixes;
        with `host_plan`, the fused kernel's host plan too (for the triton backend);
        `kept_prefix` as the field says (None when no row holds any)."""
        prefix_lens = [p.shape[0] for p in prefix_tensors]
        prefix_lens_cpu = torch.tensor(prefix_lens, dtype=torch.int64)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
        prefix_num_tokens = sum(prefix_lens)
        extend_num_tokens = sum(seq_lens) - prefix_num_tokens
        num_pages = pages.extend_new_pages(prefix_lens, seq_lens, page_size, extend_num_tokens)
        kernel_plan = kernels.extend_host_plan(prefix_lens_cpu, seq_lens_cpu, prefix_tensors, page_size) \
            if host_plan else None
        if kept_prefix is not None and not any(kept_prefix):
            kept_prefix = None
        return cls(rows, prefix_lens_cpu, seq_lens_cpu, prefix_tensors, extend_num_tokens, num_pages, prefix_num_tokens,
                   kernel_plan, kept_prefix)

    @property
    def extend_lens_cpu(self) -> torch.Tensor:
        return self.seq_lens_cpu - self.prefix_lens_cpu


class ExtendAllocation(NamedTuple):
    """What `alloc_extend` gives back (the requests' records are already updated)."""

    out_cache_loc: torch.Tensor  # the new tokens' slots, request after request
    req_pool_indices: torch.Tensor  # request rows, on the device
    rows: list[int]  # the same rows, on the host (new ones filled in)
    seq_lens: torch.Tensor  # the batch's sequence lengths, on the device


class Usage(NamedTuple):
    """Token counts for reports and budgets."""

    available: int  # free in the allocator
    evictable: int  # cached, unlocked
    protected: int  # cached, locked by some request


class LaggingRelease(NamedTuple):
    """A release under the overlap loop, of a request whose last batch is still in flight."""

    extra: bool  # a slot beyond what was released is still held by the batch in flight
    slot: Optional[InFlightSlot]  # that slot, when it opened a page of its own (freed later)


class MemoryManager:
    """Request table, KV allocator, tree cache and page size of one stack, behind paired verbs.

    `stack` is any value with `req_to_token_pool`, `allocator` and `tree_cache` (the stack
    builder's `MemoryStack`); the manager never builds components itself.
    """

    def __init__(self, stack: Any):
        self.stack = stack
        self.req_to_token_pool = stack.req_to_token_pool
        self.allocator = stack.allocator
        self.tree_cache = stack.tree_cache
        self.device = self.req_to_token_pool.device

    # -- what memory is -------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    @property
    def size(self) -> int:
        """KV slots of the pool."""
        return self.allocator.size

    @property
    def max_running(self) -> int:
        """Request rows: the most requests that can hold memory at once."""
        return self.req_to_token_pool.size

    @property
    def sharing(self) -> bool:
        """Whether the tree shares prefixes between requests (LPM needs it)."""
        return not self.tree_cache.disable

    @property
    def keeps_no_request_state(self) -> bool:
        """Whether a release records nothing beyond the freed slots (the bench null cache), so
        that a snapshot of the allocator undoes it."""
        return isinstance(self.tree_cache, NullCache)

    def new_record(self) -> ReqKV:
        return ReqKV(self.device)

    def usage(self) -> Usage:
        """Token counts for reports and budgets: available, evictable, protected."""
        tree = self.tree_cache
        return Usage(self.allocator.available_size(), tree.evictable_size(), tree.protected_size())

    def held_pages(self, usage: Usage) -> int:
        """Pages in use that the tree does not own: held by requests (exact when memory is
        conserved; the integrity checks verify that separately, request by request)."""
        return self.held_pages_each([usage.available], usage.evictable)[0]

    def held_pages_each(self, available: list[int], evictable: int) -> list[int]:
        """`held_pages` of each of `available` with the tree as it is now (`evictable`)."""
        ps, owned = self.page_size, self.size - evictable - self.tree_cache.tree_protected_size()
        return [(owned - a) // ps for a in available]

    @property
    def in_use_tokens(self) -> int:
        """Slots the allocator has handed out (whole pages), tree and requests together."""
        return self.allocator.in_use_tokens

    def idle_state(self) -> dict:
        """Invariant 6, for a stack no request holds memory in: every row free, available +
        evictable == size, nothing protected, and the allocator's own checks."""
        allocator, tree, pool = self.allocator, self.tree_cache, self.req_to_token_pool
        available, evictable, protected = allocator.available_size(), tree.evictable_size(), tree.tree_protected_size()
        integrity = allocator.check_integrity()
        ok = (available + evictable == allocator.size and protected == 0 and pool.available_size() == pool.size
              and integrity.ok)
        return {"ok": ok, "size": allocator.size, "available": available, "evictable": evictable,
                "protected": protected, "rows_free": pool.available_size(), "rows": pool.size,
                "allocator_integrity": [str(c) for c in integrity.failures]}

    def rows_in_use(self) -> int:
        return self.req_to_token_pool.size - self.req_to_token_pool.available_size()

    @property
    def evicted_tokens_total(self) -> int:
        return getattr(self.tree_cache, "evicted_tokens_total", 0)

    def slot_at(self, row: int, position: int) -> int:
        """The KV slot written at `position` of request row `row`."""
        return int(self.req_to_token_pool.req_to_token[row, position])

    # -- prefixes -------------------------------------------------------------------------
    def match_prefix(self, req: Any, token_ids: np.ndarray) -> None:
        """Match `token_ids` in the tree and record the match in `req.kv` (no lock taken)."""
        kv = req.kv
        match = self.tree_cache.match_prefix(RadixKey(token_ids, req.extra_key))
        kv.prefix_indices, kv.last_node = match.device_indices, match.last_node
        kv.last_host_node, kv.host_hit_length = match.last_host_node, match.host_hit_length
        kv.host_skipped_len = 0
        kv.last_matched_prefix_len = kv.prefix_indices.shape[0]

    def touch_prefix(self, token_ids: np.ndarray, extra_key: Any = None) -> None:
        """Walk `token_ids` in the tree as a match does (stamps, splits), adopting nothing
        (SGLang 0.5.23's `touch_prefix`, the waiting-prefix refresh)."""
        self.tree_cache.touch_prefix(RadixKey(token_ids, extra_key))

    def lock(self, node: Any) -> None:
        """Protect a matched prefix from eviction (admission)."""
        self.tree_cache.inc_lock_ref(node)

    def unlock(self, node: Any) -> None:
        self.tree_cache.dec_lock_ref(node)

    def load_back(self, req: Any) -> int:
        """Load the match's host-only part back into device memory; the request's prefix
        grows by what was loaded, and its lock moves from the node it held (locked by the
        caller) to the new last node. Returns the tokens loaded."""
        kv = req.kv
        locked = kv.last_node
        new_indices, kv.last_node = self.tree_cache.init_load_back(kv.last_host_node, kv.host_hit_length)
        kv.host_skipped_len = kv.host_hit_length - len(new_indices)
        if len(new_indices):
            kv.prefix_indices = torch.cat([kv.prefix_indices, new_indices])
            kv.last_matched_prefix_len = len(kv.prefix_indices)
            kv.host_loaded_len += len(new_indices)
        if kv.last_node is not locked:
            self.lock(kv.last_node)
            self.unlock(locked)
        return len(new_indices)

    def drop_prefix(self, req: Any) -> None:
        """Undo an admission that got no memory: unlock the prefix and forget the match."""
        kv = req.kv
        self.unlock(kv.last_node)
        kv.prefix_indices = kv.prefix_indices[:0]
        kv.last_node = None

    def cache_unfinished(self, req: Any, chunked: bool = False) -> None:
        """Hand the computed prefix to the tree after a prefill or a chunk."""
        self.tree_cache.cache_unfinished_req(req, chunked=chunked)

    # -- extend ---------------------------------------------------------------------------
    def plan_extend(self, reqs: list) -> ExtendPlan:
        """The extend plan of requests as they stand: prefix = `kv.prefix_indices`, sequence =
        `fill_ids`. Checks that the lengths agree with each request's `extend_input_len`."""
        plan = ExtendPlan.build([r.kv.req_pool_idx for r in reqs], [r.kv.prefix_indices for r in reqs],
                                [len(r.fill_ids) for r in reqs], self.page_size,
                                host_plan=self.allocator.backend == "triton",
                                kept_prefix=[_prefix_in_row(r.kv) for r in reqs])
        expected = [r.extend_input_len for r in reqs]
        if [len(r.fill_ids) - p.shape[0] for r, p in zip(reqs, plan.prefix_tensors)] != expected:
            raise AssertionError(f"extend lengths {plan.extend_lens_cpu.tolist()} != extend_input_len {expected}")
        return plan

    def alloc_extend(self, plan: ExtendPlan, reqs: Optional[list] = None) -> Optional[ExtendAllocation]:
        """Request rows, then eviction when short, then KV slots written into the rows; None
        (with nothing taken) when the rows or the slots are not there (`require_extend`
        raises instead). With `reqs`, their records take the rows and lengths.

        Every count and offset comes from the plan's CPU lengths, so the capacity check
        happens on the host, and the device sees one copy and one kernel, with no sync."""
        try:
            alloc = self.require_extend(plan, None if reqs is None else [r.rid for r in reqs])
        except (OutOfMemoryError, RequestSlotsExhausted):
            return None
        if reqs is not None:
            for req, row, seq in zip(reqs, alloc.rows, plan.seq_lens_cpu.tolist()):
                req.kv.req_pool_idx, req.kv.kv_allocated_len = row, seq
        return alloc

    def require_extend(self, plan: ExtendPlan, rids: Optional[list] = None) -> ExtendAllocation:
        """`alloc_extend` that raises `OutOfMemoryError` / `RequestSlotsExhausted` (with the
        numbers) instead of returning None, and writes no request record. `rids` (the
        requests, in the plan's order) name the rows in the ledger's history when checking."""
        # Host work per call kept to plain comparisons, as in `alloc_decode`.
        allocator, pool = self.allocator, self.req_to_token_pool
        if allocator.page_size != self.tree_cache.page_size:
            self._check_page_size()
        rows, new_rows = self._rows_for(plan.rows)
        need = self._extend_need(plan)
        if need > allocator.available_size():
            self._evict_if_needed(need)
        ledger = allocator.ledger
        # With a ledger, the hand-out and the claim are one transition.
        written = allocator.alloc_extend_write(pool.req_to_token, rows, plan.prefix_lens_cpu, plan.seq_lens_cpu,
                                               plan.prefix_tensors, plan.num_pages, plan.extend_num_tokens,
                                               ledger is not None, plan.host_plan, plan.kept_prefix)
        if written is None:
            if new_rows:
                pool.free(new_rows)
            raise self.out_of_memory("prefill", plan.num_pages * self.page_size)
        if ledger is not None:
            ledger.extended(rows, new_rows, plan.prefix_lens_cpu, plan.seq_lens_cpu, plan.prefix_tensors,
                            written.out_cache_loc, rids)
        return ExtendAllocation(written.out_cache_loc, written.req_pool_indices, rows, written.seq_lens)

    def bare_extend(self, plan: ExtendPlan, rows: list[int]) -> Optional[BareExtend]:
        """The extend of `plan` into `rows` from the free list's present head, as a bare
        graph replay with none of this manager's work (`extend_graph.BareExtend`: the floor
        of `require_extend` on this device), where the extend is a graph replay (CUDA, triton
        backend, `runtime.decode_graph`) and the batch fits one; else None."""
        allocator = self.allocator
        graphs = allocator.extend_graphs
        if graphs is None or not rows or len(rows) > graphs.max_bs:
            return None
        return BareExtend(graphs, rows, plan.prefix_lens_cpu, plan.seq_lens_cpu, plan.prefix_tensors,
                          allocator.free_head, plan.num_pages, plan.extend_num_tokens, plan.host_plan)

    def _rows_for(self, req_rows: list) -> tuple[list[int], list[int]]:
        """Every request's row, taking new rows for those without one. Returns (rows, new rows)."""
        if None not in req_rows:
            return req_rows, []
        missing = [i for i, row in enumerate(req_rows) if row is None]
        new_rows = self.alloc_rows(len(missing))
        if len(missing) == len(req_rows):
            return new_rows, new_rows
        rows = list(req_rows)
        for i, row in zip(missing, new_rows):
            rows[i] = row
        return rows, new_rows

    def alloc_rows(self, num_reqs: int) -> list[int]:
        """`num_reqs` request rows; raises `RequestSlotsExhausted` when fewer are free."""
        pool = self.req_to_token_pool
        rows = pool.alloc(num_reqs)
        if rows is None:
            raise RequestSlotsExhausted(
                f"request slots exhausted: need {num_reqs} rows, {pool.available_size()} of"
                f" {pool.size} free; raise memory.max_running_requests")
        return rows

    # -- decode ---------------------------------------------------------------------------
    def can_decode(self, num_pages: int) -> bool:
        """True when a decode step opening `num_pages` pages fits, after evicting when short."""
        need = num_pages * self.page_size
        self._evict_if_needed(need)
        return self.allocator.available_size() >= need

    def alloc_decode(self, reqs: Optional[list], *, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     req_pool_indices: torch.Tensor, num_pages: int) -> Optional[DecodeAllocation]:
        """One slot per request written at column `seq_lens` (the old lengths); None when the
        pages are not free even after eviction. With `reqs`, each record grows by one slot.

        `num_pages` are the pages the step opens (`pages.decode_new_pages(seq_lens_cpu)`,
        which the batch keeps in O(1) per step). The lengths after the step come back with the
        slots: computed on the device by a graph replay (`decode_graph`), else `seq_lens + 1`.
        """
        # The steady step is one graph launch; its host work is kept to plain comparisons.
        allocator, tree = self.allocator, self.tree_cache
        page_size = allocator.page_size
        if page_size != tree.page_size:
            self._check_page_size()
        need = self._decode_need(seq_lens_cpu.shape[0], num_pages)
        if need > allocator.available_size():
            self._evict_if_needed(need)
        ledger = allocator.ledger
        # With a ledger, the hand-out and the claim are one transition.
        written = allocator.alloc_decode_write(seq_lens, seq_lens_cpu, req_pool_indices,
                                               self.req_to_token_pool.req_to_token, num_pages, ledger is not None)
        if written is None:
            return None
        if ledger is not None:
            ledger.decoded(req_pool_indices, seq_lens_cpu, written.out_cache_loc)
        if reqs is not None:
            for req in reqs:
                req.kv.kv_allocated_len += 1
        return written

    def decode_run_pages(self, seq_lens_cpu: torch.Tensor, steps: int) -> np.ndarray:
        """The pages each of the next `steps` decode steps of the batch with lengths
        `seq_lens_cpu` opens (step s opens a page for every request whose length then,
        `seq_lens + s`, is a multiple of the page size)."""
        ps, bs = self.page_size, seq_lens_cpu.numel()
        if ps == 1:
            return np.full(steps, bs, dtype=np.int64)
        by_residue = np.bincount(seq_lens_cpu.numpy() % ps, minlength=ps)
        return by_residue[(-np.arange(steps)) % ps]

    def decode_run_steps(self, seq_lens_cpu: torch.Tensor, limit: int) -> int:
        """How many of the next decode steps of this batch (at most `limit`) `alloc_decode_run`
        can take at once: each step's check (`can_decode`) and its allocation find the pages
        it opens free, with no eviction, merge or check in between (0: this stack cannot
        take runs)."""
        allocator, ps, bs = self.allocator, self.page_size, seq_lens_cpu.numel()
        if ps != self.tree_cache.page_size or not bs or not getattr(allocator, "runs_decode", False):
            return 0
        if ps == 1:
            return min(limit, allocator.available_size() // bs)
        pages = self.decode_run_pages(seq_lens_cpu, limit)
        need = (bs if self.tree_cache.evict_rule.page_per_request else pages) * ps
        free_before = allocator.available_size() - ps * (np.cumsum(pages) - pages)
        short = np.flatnonzero(free_before < need)
        return int(short[0]) if len(short) else limit

    def alloc_decode_run(self, reqs: Optional[list], *, seq_lens_cpu: torch.Tensor, req_pool_indices: torch.Tensor,
                         steps: int) -> tuple[torch.Tensor, np.ndarray]:
        """`steps` consecutive `alloc_decode` calls for the same requests, which
        `decode_run_steps` allows: the same slots in the same rows, each record `steps` slots
        longer (`reqs` None: the caller makes them longer, `grow_records`). Returns the last
        step's slots and the pages each step opened.

        When checking, the ledger is told each step on its own, under its step number (the
        ledger's step when the run starts is its first): the same hand-outs, claims, history
        and errors as the steps one by one."""
        opened = self.decode_run_pages(seq_lens_cpu, steps)
        if int(opened.sum()) * self.page_size > self.allocator.available_size():
            raise ValueError(f"{steps} decode steps of {seq_lens_cpu.numel()} requests do not fit without eviction")
        ledger, observe = self.allocator.ledger, None
        if ledger is not None:
            first = ledger.step

            def observe(step: int, slots: np.ndarray) -> None:
                ledger.step = first + step
                ledger.decoded(req_pool_indices, seq_lens_cpu + step, slots)

        out = self.allocator.alloc_decode_run_write(seq_lens_cpu, req_pool_indices, self.req_to_token_pool.req_to_token,
                                                    opened, observe)
        if reqs is not None:
            self.grow_records(reqs, steps)
        return out, opened

    def alloc_decode_run_leaving(self, *, seq_lens_cpu: torch.Tensor, req_pool_indices: torch.Tensor,
                                 present: np.ndarray) -> np.ndarray:
        """Decode steps of a run whose batch loses requests as it goes, in one allocation
        (`present[s, i]`: request i has a slot at step s; `seq_lens_cpu` the lengths at the
        first of them), without a ledger, at page size 1: requests that leave free only to
        the free list's tail, behind what the run takes, so each step finds the slots its own
        call would find. The records are not lengthened (`grow_records`). Returns the pages
        each step took; raises ValueError, taking nothing, where they are not free without
        eviction."""
        return self.allocator.alloc_decode_run_leaving_write(seq_lens_cpu, req_pool_indices,
                                                             self.req_to_token_pool.req_to_token, present)

    def paged_run_leaving(self, *, seq_lens_cpu: torch.Tensor, req_pool_indices: torch.Tensor,
                          present: np.ndarray) -> PagedRun:
        """`alloc_decode_run_leaving` at page size > 1, where frees go back in front of the free
        list: the run planned at once, its pages taken in pieces, each after the releases
        before it (`PagedRun`), without a ledger. The records are not lengthened."""
        return self.allocator.decode_run_leaving(seq_lens_cpu, req_pool_indices, self.req_to_token_pool.req_to_token,
                                                 present)

    @staticmethod
    def grow_records(reqs: list, slots: int) -> None:
        """Each request's record holds `slots` more slots: what `alloc_decode_run` without its
        requests allocated for them (a run of decode steps whose batch changes as requests
        finish counts each one's steps itself)."""
        for req in reqs:
            req.kv.kv_allocated_len += slots

    # -- computed KV and release ----------------------------------------------------------
    def commit(self, req: Any, kv_len: int) -> None:
        """The first `kv_len` positions of the request's row hold computed K/V."""
        req.kv.kv_committed_len = kv_len

    def commit_each(self, reqs: list, kv_lens: list[int]) -> None:
        """`commit(req, kv_len)` for each pair (a decode result's requests, in one call)."""
        for req, kv_len in zip(reqs, kv_lens):
            req.kv.kv_committed_len = kv_len

    def commit_one_more(self, reqs: list) -> None:
        """`commit(req, kv_committed_len + 1)` for each request (a decode step's result)."""
        for req in reqs:
            req.kv.kv_committed_len += 1

    def release(self, req: Any, why: Release = Release.FINISHED) -> None:
        """Give back everything the request holds (its prefix enters the tree unless
        retracted); a retracted request's record is emptied for its next admission."""
        ledger = getattr(self.req_to_token_pool, "ledger", None)
        if ledger is None:
            self.tree_cache.cache_finished_req(req, is_insert=why.inserts)
        else:  # the history names the request and why for every page it gives back
            ledger.acting = (str(req.rid), why.value)
            try:
                self.tree_cache.cache_finished_req(req, is_insert=why.inserts)
            finally:
                ledger.acting = None
        if why is Release.RETRACTED:
            req.kv.reset()

    def release_lagging(self, req: Any, kv_len: int, why: Release) -> LaggingRelease:
        """Release as SGLang's overlap loop does: the first `kv_len` positions now; a slot
        beyond them, allocated by a batch still in flight, is held apart (`slot`, freed with
        `free_in_flight` when that batch's result is processed) when it opened a page of its
        own, else it went with the request's last page."""
        kv = req.kv
        extra = kv.kv_allocated_len - kv_len
        if extra > 1:
            raise AssertionError(f"request {req.rid}: {extra} slots in flight, at most one expected")
        ps, slot = self.page_size, None
        own_page = bool(extra) and (ps == 1 or kv_len % ps == 0)
        if own_page:
            slot = InFlightSlot(req.rid, kv_len, self.slot_at(kv.req_pool_idx, kv_len))
            self._hold_in_flight(kv.req_pool_idx, slot.slot)
        kv.kv_committed_len = kv.kv_allocated_len = kv_len
        self.release(req, why)
        return LaggingRelease(bool(extra), slot)

    def _hold_in_flight(self, row: int, slot: int) -> None:
        """The page of a decode slot still in flight leaves its request row before the row is
        released. Only the ownership ledger, when checking is on, records anything."""
        ledger = getattr(self.req_to_token_pool, "ledger", None)
        if ledger is not None:
            ledger.move(np.array([slot], dtype=np.int64), row, IN_FLIGHT, "decode slot in flight")

    def free_in_flight(self, slots: list[int]) -> None:
        """Give back KV slots that neither a request row nor the tree holds: decode slots in
        flight when their request was released. Paged: frees the page of each slot."""
        allocator = self.allocator
        slots = torch.as_tensor(slots, dtype=torch.int64, device=allocator.device)  # beside the batch's other frees
        if getattr(allocator, "ledger", None) is not None:  # IN_FLIGHT -> FREE in one transition
            allocator.free(slots, owner=IN_FLIGHT, op="free of a decode slot in flight")
        else:
            allocator.free(slots)

    def free_row(self, req: Any) -> None:
        """Give back the request's row, whose KV slots live on (handed over as a prefix);
        frees no KV slot. With a ledger, the pages the row still owns (a chunk's partial
        page) go with the request (CARRIED)."""
        pool, row = self.req_to_token_pool, req.kv.req_pool_idx
        if getattr(pool, "ledger", None) is not None:
            pool.ledger.carry_row(row)
        pool.free([row])
        req.kv.req_pool_idx = None

    def release_all(self, reqs: list, req_pool_indices: Optional[torch.Tensor] = None) -> None:
        """Release every request of a static batch as `release(req)` would.

        With the null cache a finished request gives back every slot of its row, so requests
        that all hold the same number of slots are released with one gather of `req_to_token`
        and one allocator free (`free_row_pages`) instead of one release per request;
        `req_pool_indices` (the rows on the device, when the caller has them) saves a copy
        when the rows are not consecutive. Other caches release per request inside one free
        group. Raises `IntegrityError` when a request was already released.
        """
        if isinstance(self.tree_cache, NullCache):
            rows = _uniform_rows(reqs)
            if rows is not None:
                pool = self.req_to_token_pool
                free_row_pages(pool, self.allocator, rows.rows, rows.length, consecutive=rows.consecutive,
                               row_index=req_pool_indices)
                if rows.consecutive:
                    pool.free_range(rows.rows[0], len(rows.rows))
                else:
                    pool.free(rows.rows)
                for req in reqs:
                    req.kv.kv_freed = True
                return
        with self.free_group():
            for req in reqs:
                self.release(req)

    def free_group(self) -> "_FreeGroup":
        """Context manager batching the frees of a result-processing loop into one."""
        return _FreeGroup(self.allocator)

    # -- eviction -------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Evict up to `num_tokens` unlocked tokens from the tree; returns the tokens freed
        (possibly more, to whole pages; evicting 0 is always safe)."""
        return self.tree_cache.evict(num_tokens) if num_tokens > 0 else 0

    def evict_for(self, need_tokens: int) -> int:
        """Evict when fewer than `need_tokens` are free (`_evict_if_needed`)."""
        return self._evict_if_needed(need_tokens)

    def _evict_if_needed(self, need_tokens: int) -> int:
        """When `available_size()` is short of `need_tokens`, evict the shortfall (or the whole
        need, under `evict_rule.full_need`). Returns the tokens freed."""
        shortfall = need_tokens - self.allocator.available_size()
        if shortfall <= 0:
            return 0
        return self.tree_cache.evict(need_tokens if self.tree_cache.evict_rule.full_need else shortfall)

    def _extend_need(self, plan: ExtendPlan) -> int:
        """Free tokens to have before an extend allocation: the exact pages, or SGLang's estimate."""
        page_size = self.page_size
        if self.tree_cache.evict_rule.page_per_request and page_size > 1:
            return plan.extend_num_tokens + len(plan.rows) * page_size
        return plan.num_pages * page_size

    def _decode_need(self, num_reqs: int, num_pages: int) -> int:
        """Free tokens to have before a decode allocation: the exact pages, or SGLang's estimate."""
        page_size = self.allocator.page_size
        if page_size > 1 and self.tree_cache.evict_rule.page_per_request:
            return num_reqs * page_size
        return num_pages * page_size

    def out_of_memory(self, what: str, need_tokens: int) -> OutOfMemoryError:
        u = self.usage()
        return OutOfMemoryError(what, need_tokens, u.available, u.evictable, u.protected)

    def _check_page_size(self) -> None:
        if self.allocator.page_size != self.tree_cache.page_size:
            raise PageSizeMismatch(
                f"page size mismatch: allocator {self.allocator.page_size}, tree cache {self.tree_cache.page_size};"
                " every component must take memory.page_size")

    def store_kv(self, out_cache_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V (layers, tokens, heads, head_dim) of new tokens at `out_cache_loc` of
        every layer of the KV pool (which must be materialized)."""
        pool = self.stack.kv_pool
        kernels.store_kv(pool.k_buffer, pool.v_buffer, out_cache_loc, k, v, backend=self.stack.backend)

    # -- snapshots (bench-one-batch replays one step many times) --------------------------
    def snapshot(self) -> Any:
        """The allocator's free list and counters, to `restore` later."""
        return self.allocator.backup_state()

    def restore(self, state: Any, reqs: list, kv_allocated_lens: Optional[list[int]] = None) -> None:
        """The allocator back to `state`; with `kv_allocated_lens` the requests' records too
        (their rows kept), else the rows are cleared and the records hold no row."""
        self.allocator.restore_state(state)
        if kv_allocated_lens is not None:
            for req, n in zip(reqs, kv_allocated_lens):
                req.kv.kv_allocated_len = n
            return
        self.req_to_token_pool.clear()
        for req in reqs:
            req.kv.req_pool_idx, req.kv.kv_allocated_len = None, 0

    def retake_rows(self, reqs: list) -> None:
        """After `restore` of a state taken before their release: the requests' rows, taken
        again from a cleared table (the same rows, in the same order), and not freed."""
        pool = self.req_to_token_pool
        pool.clear()
        rows = pool.alloc(len(reqs))
        if rows != [req.kv.req_pool_idx for req in reqs]:
            raise IntegrityError(f"restoring the finish took rows {rows[:8]}..., not the batch's rows")
        for req in reqs:
            req.kv.kv_freed = False

    def clear_rows(self) -> None:
        """Every request row free again, in the table's first order (no request holds one)."""
        self.req_to_token_pool.clear()

    def adopt_prefix(self, req: Any, prefix: torch.Tensor) -> None:
        """Give the request `prefix` as its prefix slots (handed over by an earlier request)."""
        req.kv.prefix_indices = prefix

    def commit_allocated(self, reqs: list) -> None:
        """Every allocated position of the requests holds computed K/V."""
        for req in reqs:
            req.kv.kv_committed_len = req.kv.kv_allocated_len

    # -- integrity ------------------------------------------------------------------------
    def checker(self, policy: CheckPolicy) -> IntegrityChecker:
        """The after-step checks of this memory under `policy` (it may install the ledger)."""
        return IntegrityChecker(self.stack, policy)

    def check(self, holders: list) -> list:
        """The full walk of memory now, with `holders` (requests and in-flight slots) as
        what holds memory outside the tree; returns the reports (raises on a failure)."""
        return check_memory(self.stack, holders)

    # -- the host tier --------------------------------------------------------------------
    def host_tier(self) -> Optional[Any]:
        """The host tier's counters (None without one)."""
        return self.tree_cache.host_tier()

    def ack_host_copies(self) -> None:
        """Acknowledge finished host copies (their nodes unlock)."""
        self.tree_cache.check_hicache_events()

    def next_copy_end(self) -> Optional[float]:
        """When the oldest host copy in flight ends (None: none in flight)."""
        return self.tree_cache.next_copy_end()

    def start_load_backs(self) -> Optional[float]:
        """Start the load-backs queued by admission; when they end (None: none queued)."""
        return self.tree_cache.ready_to_load_host_cache()

    def host_quiet_until(self) -> float:
        """Until when (simulated ms) the host tier leaves a decode step alone: the end of the
        first copy in flight (inf: none, or no host tier); 0 while a write-back wait is still
        to be paid."""
        tree = self.tree_cache
        if tree.pending_transfer_stall_ms() > 0:
            return 0.0
        end = tree.next_copy_end()
        return math.inf if end is None else end

    def take_transfer_stall_ms(self) -> float:
        return self.tree_cache.take_transfer_stall_ms()

    def record_load_wait(self, wait_ms: float) -> None:
        self.host_tier().record_load_wait(wait_ms)

    def finish_copies(self) -> None:
        """Wait for the host tier's last copies (the end of a run)."""
        self.tree_cache.finish_copies()

    def set_clock(self, clock) -> None:
        """The time the tree stamps and ages by (a zero-argument callable)."""
        if hasattr(self.tree_cache, "clock"):
            self.tree_cache.clock = clock

    # -- what reports read ----------------------------------------------------------------
    def take_events(self) -> list:
        """The KV events since the last call."""
        return self.tree_cache.take_events()

    def take_evictions(self) -> list:
        """The tree's eviction records since the last call (empty without a tree)."""
        log = getattr(self.tree_cache, "eviction_log", None)
        if not log:
            return []
        records = list(log)
        log.clear()
        return records

    def allocator_totals(self) -> tuple[int, int]:
        """(frees, freed tokens) over the run."""
        return self.allocator.num_frees, self.allocator.freed_tokens


class _FreeGroup:
    def __init__(self, allocator):
        self.allocator = allocator

    def __enter__(self):
        self.allocator.free_group_begin()
        return self

    def __exit__(self, *exc):
        self.allocator.free_group_end()
        return False


class _Rows(NamedTuple):
    rows: list[int]
    length: int  # the common kv_allocated_len
    consecutive: bool  # rows[i] == rows[0] + i


def _uniform_rows(reqs: list) -> Optional[_Rows]:
    """The request rows, when every request holds the same number of slots (else None)."""
    if not reqs:
        return None
    length, first = reqs[0].kv.kv_allocated_len, reqs[0].kv.req_pool_idx
    rows, consecutive = [], True
    for i, req in enumerate(reqs):
        kv = req.kv
        if kv.kv_freed:
            raise IntegrityError(f"release of request row {kv.req_pool_idx} that was already freed")
        if kv.kv_allocated_len != length:
            return None
        consecutive = consecutive and kv.req_pool_idx == first + i
        rows.append(kv.req_pool_idx)
    return _Rows(rows, length, consecutive)
