"""Finishing a static batch: every request releases what it holds, with one free.

With the null cache a finished request gives back every slot of its row, so a whole batch
of equal-length requests is released with one gather of `req_to_token` and one allocator
free, instead of one `cache_finished_req` (a slice, a dtype copy and a list append) per
request. Other caches keep per-request bookkeeping (tree insertion, held-token counts) and
go through `cache_finished_req` per request, inside one free group.
"""

from __future__ import annotations

from typing import NamedTuple

from memcli.errors import IntegrityError
from memcli.mem_cache import common
from memcli.mem_cache.null_cache import NullCache


def release_batch(batch) -> None:
    """Release every request of `batch` as `cache_finished_req` would; mutates the stack.

    Raises `IntegrityError` when a request was already released.
    """
    tree_cache = batch.tree_cache
    if isinstance(tree_cache, NullCache):
        rows = _uniform_rows(batch.reqs)
        if rows is not None:
            _release_rows(batch, rows)
            return
    with common.free_group(batch.token_to_kv_pool_allocator):
        for req in batch.reqs:
            common.release_req(tree_cache, req, is_insert=True)


class _Rows(NamedTuple):
    rows: list[int]
    length: int  # the common kv_allocated_len
    consecutive: bool  # rows[i] == rows[0] + i


def _uniform_rows(reqs) -> _Rows | None:
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


def _release_rows(batch, rows: _Rows) -> None:
    """Free columns [0, length) of every row, then the rows.

    The allocator frees whole pages, and position t of a row sits at offset t % page_size of
    its page, so the slots of columns 0, ps, 2 ps, ... name every page of the row exactly once.
    Consecutive rows are read through a view (no index kernel).
    """
    allocator, pool = batch.token_to_kv_pool_allocator, batch.req_to_token_pool
    if rows.length:
        table, ps = pool.req_to_token, allocator.page_size
        if len(rows.rows) == 1:
            page_starts = table[rows.rows[0], 0 : rows.length : ps]
        elif rows.consecutive:
            first = rows.rows[0]
            page_starts = table[first : first + len(rows.rows), 0 : rows.length : ps]
        else:
            page_starts = table[batch.req_pool_indices, 0 : rows.length : ps]
        allocator.free(page_starts, distinct_pages=True)
    pool.free(rows.rows)
    for req in batch.reqs:
        req.kv_freed = True
