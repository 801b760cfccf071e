"""The only allocation entry points of the stack.

The scheduler never calls an allocator or writes `req_to_token` itself; it calls these
functions with a batch that carries `req_to_token_pool`, `token_to_kv_pool_allocator` and
`tree_cache`.

Extend (prefill) of request i, in its `req_to_token` row:

    [0, prefix_len)          prefix slots (`req.prefix_indices`, from the tree or earlier chunks)
    [prefix_len, seq_len)    new slots, out_cache_loc[off_i : off_i + extend_len_i]

Decode: one new slot per request, written at column `seq_len` (the old length); the caller
increments `seq_lens` afterwards.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from memcli.errors import IntegrityError, OutOfMemoryError, RequestSlotsExhausted
from memcli.mem_cache.allocator import count_new_pages


class PageSizeMismatch(IntegrityError):
    """The allocator and the tree cache disagree about the page size."""


class ExtendAllocation(NamedTuple):
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    req_pool_indices_list: list[int]
    seq_lens: torch.Tensor  # the batch's sequence lengths on the device


def assert_same_page_size(allocator, tree_cache) -> None:
    if allocator.page_size != tree_cache.page_size:
        raise PageSizeMismatch(
            f"page size mismatch: allocator {allocator.page_size}, tree cache {tree_cache.page_size};"
            " every component must take memory.page_size"
        )


def extend_pages_needed(page_size: int, prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor,
                        extend_num_tokens: int | None = None) -> int:
    """Pages an extend batch opens (`allocator.count_new_pages`); `extend_num_tokens` (the
    batch's new tokens, when known) answers page size 1 at once."""
    if page_size == 1 and extend_num_tokens is not None:
        return extend_num_tokens
    return count_new_pages(page_size, prefix_lens_cpu, seq_lens_cpu)


def decode_pages_needed(page_size: int, seq_lens_cpu: torch.Tensor) -> int:
    """Pages the next decode step opens: requests whose new position starts a page.

    `seq_lens_cpu` are the lengths before the step. Counted with numpy on the CPU twin: no
    device work and no host sync.
    """
    if page_size == 1:
        return int(seq_lens_cpu.numel())
    return int(np.count_nonzero(seq_lens_cpu.numpy() % page_size == 0))


def decode_tokens_needed(allocator, seq_lens_cpu: torch.Tensor) -> int:
    """Free tokens the next decode step takes; `seq_lens_cpu` are the lengths before it."""
    return decode_pages_needed(allocator.page_size, seq_lens_cpu) * allocator.page_size


def evict_if_needed(tree_cache, allocator, need_tokens: int) -> int:
    """Evict only the shortfall, and only when `available_size()` is short. Returns tokens freed."""
    shortfall = need_tokens - allocator.available_size()
    if shortfall <= 0:
        return 0
    return tree_cache.evict(shortfall)


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


def alloc_for_extend(batch) -> ExtendAllocation:
    """Request rows, then eviction of the shortfall, then KV slots written into the rows.

    Reads the fields `prepare_for_extend` set: `batch.req_rows` (row per request, None for
    a request without one), `batch.prefix_tensors` (each request's `prefix_indices`),
    `batch.prefix_lens_cpu`, `batch.seq_lens_cpu` and `batch.extend_num_tokens`. Every
    count and offset comes from the CPU lengths, so the capacity check happens on the host,
    and the device sees one copy (the batch's plan) and one kernel (`alloc_extend_write`),
    with no sync.
    On failure raises `OutOfMemoryError` and returns the rows it took.
    """
    allocator, tree_cache, pool = batch.token_to_kv_pool_allocator, batch.tree_cache, batch.req_to_token_pool
    assert_same_page_size(allocator, tree_cache)
    rows, new_rows = _rows_for(pool, batch.req_rows)
    num_pages = extend_pages_needed(allocator.page_size, batch.prefix_lens_cpu, batch.seq_lens_cpu,
                                    batch.extend_num_tokens)
    need = num_pages * allocator.page_size
    if need > allocator.available_size():
        evict_if_needed(tree_cache, allocator, need)
    written = allocator.alloc_extend_write(pool.req_to_token, rows, batch.prefix_lens_cpu, batch.seq_lens_cpu,
                                           batch.prefix_tensors, num_pages, batch.extend_num_tokens)
    if written is None:
        if new_rows:
            pool.free(new_rows)
        raise out_of_memory("prefill", tree_cache, allocator, need)
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


def alloc_for_decode(batch, token_per_req: int = 1) -> torch.Tensor:
    """One slot per request written at column `batch.seq_lens` (the old lengths).

    The pages the step opens come from `batch.decode_pages_needed(page_size)` (O(1) per step
    on a `ScheduleBatch`). Evicts the exact shortfall first. The caller increments
    `seq_lens` afterwards.
    """
    if token_per_req != 1:
        raise ValueError("alloc_for_decode supports one token per request")
    allocator, tree_cache, pool = batch.token_to_kv_pool_allocator, batch.tree_cache, batch.req_to_token_pool
    assert_same_page_size(allocator, tree_cache)
    num_pages = batch.decode_pages_needed(allocator.page_size)
    need = num_pages * allocator.page_size
    if need > allocator.available_size():
        evict_if_needed(tree_cache, allocator, need)
    out = allocator.alloc_decode_write(batch.seq_lens, batch.seq_lens_cpu, batch.req_pool_indices,
                                       pool.req_to_token, num_pages=num_pages)
    if out is None:
        raise out_of_memory("decode", tree_cache, allocator, need)
    return out


def check_decode_mem(batch, seq_lens_cpu: torch.Tensor | None = None) -> bool:
    """True when the next decode step of these requests fits, after evicting the shortfall."""
    allocator = batch.token_to_kv_pool_allocator
    if seq_lens_cpu is None:
        need = batch.decode_pages_needed(allocator.page_size) * allocator.page_size
    else:
        need = decode_tokens_needed(allocator, seq_lens_cpu)
    evict_if_needed(batch.tree_cache, allocator, need)
    return allocator.available_size() >= need


def release_req(tree_cache, req, is_insert: bool = True) -> None:
    """Release everything a finished (or, with is_insert=False, retracted) request holds."""
    tree_cache.cache_finished_req(req, is_insert=is_insert)


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


def usage(tree_cache, allocator) -> dict[str, int]:
    """Token counts for reports: available, evictable, protected."""
    return {
        "available": allocator.available_size(),
        "evictable": tree_cache.evictable_size(),
        "protected": tree_cache.protected_size(),
    }
