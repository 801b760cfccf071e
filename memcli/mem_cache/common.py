"""The only allocation and release entry points of the stack.

The scheduler never calls an allocator or writes `req_to_token` itself. It hands memory
named values and receives named values back; nothing here calls back into the scheduler
or writes a field of a request (the tree caches' `cache_*_req` do, as in SGLang; see
`BasePrefixCache`).

    scheduler                              mem_cache.common
    ExtendPlan (rows, lengths, prefixes) -> alloc_for_extend -> ExtendAllocation
    seq_lens + num_pages (decode)        -> alloc_for_decode -> out_cache_loc
    num_pages                            -> check_decode_mem -> bool
    request (finish, abort, retract)     -> release_req      (tree cache frees)
    in-flight decode slots (overlap)     -> free_slots
    requests of a static batch           -> release_reqs     (one free where possible)

Extend (prefill) of request i, in its `req_to_token` row:

    [0, prefix_len)          prefix slots (`req.prefix_indices`, from the tree or earlier chunks)
    [prefix_len, seq_len)    new slots, out_cache_loc[off_i : off_i + extend_len_i]

Decode: one new slot per request, written at column `seq_len` (the old length); the caller
increments `seq_lens` afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch

from memcli.errors import IntegrityError, OutOfMemoryError, RequestSlotsExhausted
from memcli.mem_cache import pages
from memcli.mem_cache.allocator import DecodeAllocation
from memcli.mem_cache.chunk_cache import free_row_pages
from memcli.mem_cache.integrity.ownership import IN_FLIGHT
from memcli.mem_cache.null_cache import NullCache


class PageSizeMismatch(IntegrityError):
    """The allocator and the tree cache disagree about the page size."""


@dataclass(frozen=True, slots=True)
class ExtendPlan:
    """What an extend batch asks of memory; built by the batch, read by `alloc_for_extend`.

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

    @classmethod
    def build(cls, rows: list[Optional[int]], prefix_tensors: list[torch.Tensor], seq_lens: list[int],
              page_size: int) -> "ExtendPlan":
        """The plan of requests whose rows will hold `seq_lens` tokens after their prefixes."""
        prefix_lens = [len(p) for p in prefix_tensors]
        prefix_lens_cpu = torch.tensor(prefix_lens, dtype=torch.int64)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
        extend_num_tokens = sum(seq_lens) - sum(prefix_lens)
        num_pages = pages.extend_new_pages(prefix_lens_cpu, seq_lens_cpu, page_size, extend_num_tokens)
        return cls(rows, prefix_lens_cpu, seq_lens_cpu, prefix_tensors, extend_num_tokens, num_pages)

    @property
    def extend_lens_cpu(self) -> torch.Tensor:
        return self.seq_lens_cpu - self.prefix_lens_cpu


class ExtendAllocation(NamedTuple):
    """What `alloc_for_extend` gives back; the batch applies it to itself and its requests."""

    out_cache_loc: torch.Tensor  # the new tokens' slots, request after request
    req_pool_indices: torch.Tensor  # request rows, on the device
    rows: list[int]  # the same rows, on the host (new ones filled in)
    seq_lens: torch.Tensor  # the batch's sequence lengths, on the device


class Usage(NamedTuple):
    """Token counts for reports and budgets."""

    available: int  # free in the allocator
    evictable: int  # cached, unlocked
    protected: int  # cached, locked by some request


def assert_same_page_size(allocator, tree_cache) -> None:
    if allocator.page_size != tree_cache.page_size:
        raise PageSizeMismatch(
            f"page size mismatch: allocator {allocator.page_size}, tree cache {tree_cache.page_size};"
            " every component must take memory.page_size"
        )


def evict_if_needed(tree_cache, allocator, need_tokens: int) -> int:
    """When `available_size()` is short of `need_tokens`, evict the shortfall (or the whole
    need, under `tree_cache.evict_rule.full_need`). Returns the tokens freed."""
    shortfall = need_tokens - allocator.available_size()
    if shortfall <= 0:
        return 0
    return tree_cache.evict(need_tokens if tree_cache.evict_rule.full_need else shortfall)


def extend_need(plan: "ExtendPlan", tree_cache, page_size: int) -> int:
    """Free tokens to have before an extend allocation: the exact pages, or SGLang's estimate."""
    if tree_cache.evict_rule.page_per_request and page_size > 1:
        return plan.extend_num_tokens + len(plan.rows) * page_size
    return plan.num_pages * page_size


def decode_need(tree_cache, num_reqs: int, num_pages: int, page_size: int) -> int:
    """Free tokens to have before a decode allocation: the exact pages, or SGLang's estimate."""
    if page_size > 1 and tree_cache.evict_rule.page_per_request:
        return num_reqs * page_size
    return num_pages * page_size


def out_of_memory(what: str, tree_cache, allocator, need_tokens: int) -> OutOfMemoryError:
    return OutOfMemoryError(what, need_tokens, allocator.available_size(), tree_cache.evictable_size(),
                            tree_cache.protected_size())


def alloc_req_slots(req_to_token_pool, num_reqs: int) -> list[int]:
    rows = req_to_token_pool.alloc(num_reqs)
    if rows is None:
        raise RequestSlotsExhausted(
            f"request slots exhausted: need {num_reqs} rows, {req_to_token_pool.available_size()} of"
            f" {req_to_token_pool.size} free; raise memory.max_running_requests"
        )
    return rows


def alloc_for_extend(plan: ExtendPlan, req_to_token_pool, allocator, tree_cache) -> ExtendAllocation:
    """Request rows, then eviction when short (`evict_if_needed`), then KV slots written into the rows.

    Every count and offset comes from the plan's CPU lengths, so the capacity check happens
    on the host, and the device sees one copy and one kernel (`alloc_extend_write`), with no
    sync. Mutates the pool, the allocator and (eviction) the tree; writes no request field.
    On failure raises `OutOfMemoryError` and returns the rows it took.
    """
    assert_same_page_size(allocator, tree_cache)
    rows, new_rows = _rows_for(req_to_token_pool, plan.rows)
    need = extend_need(plan, tree_cache, allocator.page_size)
    evict_if_needed(tree_cache, allocator, need)
    ledger = getattr(allocator, "ledger", None)
    kw = {} if ledger is None else {"claimed": True}  # hand-out and claim in one ledger transition
    written = allocator.alloc_extend_write(req_to_token_pool.req_to_token, rows, plan.prefix_lens_cpu,
                                           plan.seq_lens_cpu, plan.prefix_tensors, plan.num_pages,
                                           plan.extend_num_tokens, **kw)
    if written is None:
        if new_rows:
            req_to_token_pool.free(new_rows)
        raise out_of_memory("prefill", tree_cache, allocator, plan.num_pages * allocator.page_size)
    if ledger is not None:
        ledger.extended(rows, new_rows, plan.prefix_lens_cpu, plan.seq_lens_cpu, plan.prefix_tensors,
                                  written.out_cache_loc)
    return ExtendAllocation(written.out_cache_loc, written.req_pool_indices, rows, written.seq_lens)


def _rows_for(pool, req_rows: list) -> tuple[list[int], list[int]]:
    """Every request's row, taking new rows for those without one. Returns (rows, new rows)."""
    if None not in req_rows:
        return req_rows, []
    missing = [i for i, row in enumerate(req_rows) if row is None]
    new_rows = alloc_req_slots(pool, len(missing))
    if len(missing) == len(req_rows):
        return new_rows, new_rows
    rows = list(req_rows)
    for i, row in zip(missing, new_rows):
        rows[i] = row
    return rows, new_rows


def alloc_for_decode(req_to_token_pool, allocator, tree_cache, *, seq_lens: torch.Tensor,
                     seq_lens_cpu: torch.Tensor, req_pool_indices: torch.Tensor, num_pages: int) -> DecodeAllocation:
    """One slot per request written at column `seq_lens` (the old lengths).

    `num_pages` are the pages the step opens (`pages.decode_new_pages(seq_lens_cpu)`, which
    the batch keeps in O(1) per step). Evicts first when short (`evict_if_needed`). The
    lengths after the step come back with the slots: computed on the device by a graph
    replay (`decode_graph`), else `seq_lens + 1`; the caller keeps its host lengths itself.
    Raises `OutOfMemoryError` when the pages are not free.
    """
    # The steady step is one graph launch; its host work is kept to plain comparisons.
    page_size = allocator.page_size
    if page_size != tree_cache.page_size:
        assert_same_page_size(allocator, tree_cache)
    need = decode_need(tree_cache, seq_lens_cpu.shape[0], num_pages, page_size)
    if need > allocator.available_size():
        evict_if_needed(tree_cache, allocator, need)
    ledger = allocator.ledger
    # With a ledger, the hand-out and the claim are one transition.
    written = allocator.alloc_decode_write(seq_lens, seq_lens_cpu, req_pool_indices, req_to_token_pool.req_to_token,
                                           num_pages, ledger is not None)
    if written is None:
        raise out_of_memory("decode", tree_cache, allocator, num_pages * page_size)
    if ledger is not None:
        ledger.decoded(req_pool_indices, seq_lens_cpu, written.out_cache_loc)
    return written


def check_decode_mem(allocator, tree_cache, num_pages: int) -> bool:
    """True when a decode step opening `num_pages` pages fits, after evicting when short."""
    need = num_pages * allocator.page_size
    evict_if_needed(tree_cache, allocator, need)
    return allocator.available_size() >= need


def release_req(tree_cache, req, is_insert: bool = True) -> None:
    """Release everything a finished (or, with is_insert=False, retracted) request holds."""
    tree_cache.cache_finished_req(req, is_insert=is_insert)


def slot_at(req_to_token_pool, row: int, position: int) -> int:
    """The KV slot written at `position` of request row `row`."""
    return int(req_to_token_pool.req_to_token[row, position])


def hold_in_flight(req_to_token_pool, row: int, slot: int) -> None:
    """Under overlap scheduling, the page of a decode slot still in flight leaves its request
    row before the row is released (it is freed later through `free_slots`). Only the
    ownership ledger, when checking is on, records anything."""
    ledger = getattr(req_to_token_pool, "ledger", None)
    if ledger is not None:
        ledger.move(np.array([slot], dtype=np.int64), row, IN_FLIGHT, "decode slot in flight")


def free_slots(allocator, slots: list[int] | torch.Tensor) -> None:
    """Give back KV slots that neither a request row nor the tree holds: under overlap
    scheduling, a decode slot still in flight when its request was released. Paged: frees the
    page of each slot (the caller frees a slot only when no other slot shares its page)."""
    slots = torch.as_tensor(slots, dtype=torch.int64, device=allocator.device)  # beside the batch's other frees
    if getattr(allocator, "ledger", None) is not None:  # IN_FLIGHT -> FREE in one transition
        allocator.free(slots, owner=IN_FLIGHT, op="free of a decode slot in flight")
    else:
        allocator.free(slots)


def free_req_rows(req_to_token_pool, rows: list[int]) -> None:
    """Give back request rows whose KV slots live on elsewhere (handed over as another
    request's prefix); frees no KV slot. Raises `ValueError` on a double free. With a ledger,
    the pages a row still owns (a chunk's partial page) go with its request (CARRIED)."""
    if getattr(req_to_token_pool, "ledger", None) is not None:
        for row in rows:
            req_to_token_pool.ledger.carry_row(row)
    req_to_token_pool.free(rows)


def release_reqs(tree_cache, reqs: list, req_pool_indices: Optional[torch.Tensor] = None) -> None:
    """Release every request of a static batch as `cache_finished_req(is_insert=True)` would.

    With the null cache a finished request gives back every slot of its row, so requests
    that all hold the same number of slots are released with one gather of `req_to_token`
    and one allocator free (`free_row_pages`), instead of one `cache_finished_req` (a slice,
    a dtype copy and a list append) per request; `req_pool_indices` (the rows on the
    device, when the caller has them) saves a copy when the rows are not consecutive. The
    fast path sets `req.kv_freed` as `cache_finished_req` does. Other caches keep
    per-request bookkeeping (tree insertion, held-token counts) and go through
    `cache_finished_req` per request, inside one free group. Mutates the stack; raises
    `IntegrityError` when a request was already released.
    """
    if isinstance(tree_cache, NullCache):
        rows = _uniform_rows(reqs)
        if rows is not None:
            free_row_pages(tree_cache.req_to_token_pool, tree_cache.allocator, rows.rows, rows.length,
                           consecutive=rows.consecutive, row_index=req_pool_indices)
            tree_cache.req_to_token_pool.free(rows.rows)
            for req in reqs:
                req.kv_freed = True
            return
    with free_group(tree_cache.allocator):
        for req in reqs:
            release_req(tree_cache, req, is_insert=True)


class _Rows(NamedTuple):
    rows: list[int]
    length: int  # the common kv_allocated_len
    consecutive: bool  # rows[i] == rows[0] + i


def _uniform_rows(reqs: list) -> Optional[_Rows]:
    """The request rows, when every request holds the same number of slots (else None)."""
    if not reqs:
        return None
    length, first = reqs[0].kv_allocated_len, reqs[0].req_pool_idx
    rows, consecutive = [], True
    for i, req in enumerate(reqs):
        if req.kv_freed:
            raise IntegrityError(f"release of request row {req.req_pool_idx} that was already freed")
        if req.kv_allocated_len != length:
            return None
        consecutive = consecutive and req.req_pool_idx == first + i
        rows.append(req.req_pool_idx)
    return _Rows(rows, length, consecutive)


def cache_unfinished(tree_cache, req, chunked: bool = False) -> None:
    """Hand the computed prefix to the tree after a prefill or a chunk."""
    tree_cache.cache_unfinished_req(req, chunked=chunked)


def free_group(allocator):
    """Context manager batching the frees of a result-processing loop into one."""
    return _FreeGroup(allocator)


class _FreeGroup:
    def __init__(self, allocator):
        self.allocator = allocator

    def __enter__(self):
        self.allocator.free_group_begin()
        return self

    def __exit__(self, *exc):
        self.allocator.free_group_end()
        return False


def usage(tree_cache, allocator) -> Usage:
    """Token counts for reports and budgets: available, evictable, protected."""
    return Usage(allocator.available_size(), tree_cache.evictable_size(), tree_cache.protected_size())
