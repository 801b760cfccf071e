"""ChunkCache: no prefix sharing; only carries a request's own slots between chunks.

Used when the radix cache is disabled. Every request owns all its slots, from its first
chunk to its finish. The cache itself owns nothing, so `evictable_size()` and
`tree_protected_size()` are 0: what requests hold is counted as held by running requests in
the conservation check (`memcli.mem_cache.integrity`), once. `protected_size()` is 0 too, or,
with `count_protected` (SGLang), the tokens of the requests' recorded prefixes, as SGLang
reports them.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from memcli.check_result import CheckResult, IntegrityReport
from memcli.errors import IntegrityError
from memcli.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult, RadixKey


def free_row_pages(req_to_token_pool: Any, allocator: Any, rows: list[int], length: int,
                   consecutive: bool = False, row_index: Optional[torch.Tensor] = None) -> None:
    """Free every page of columns [0, length) of each of `rows`, with one allocator free.

    Only for rows that hold nothing but their own slots (no tree prefix). Position t of a
    row sits at offset t % page_size of its page, so the slots of columns 0, ps, 2 ps, ...
    name every page of the row exactly once. One row, or `consecutive` rows (rows[i] ==
    rows[0] + i), are read through a view (no index kernel); other rows are gathered by
    `row_index` (the rows on the device; built from `rows` when not given). On the triton
    backend, outside debug mode and without an observer, one kernel reads the rows and writes
    the free list instead (`allocator.free_rows`). Does not free the rows themselves.
    """
    if not length:
        return
    table, ps = req_to_token_pool.req_to_token, allocator.page_size
    free_rows = getattr(allocator, "free_rows", None)
    if free_rows is not None and free_rows(table, rows, length, consecutive or len(rows) == 1, row_index):
        return  # one launch read the rows and wrote the free list
    if len(rows) == 1:
        page_starts = table[rows[0], 0:length:ps]
    elif consecutive:
        page_starts = table[rows[0] : rows[0] + len(rows), 0:length:ps]
    else:
        if row_index is None:
            row_index = torch.tensor(rows, dtype=torch.int64, device=table.device)
        page_starts = table[row_index, 0:length:ps]
    if getattr(allocator, "ledger", None) is not None:  # each row -> FREE in one transition
        owners = np.repeat(np.asarray(rows, dtype=np.int64), page_starts.numel() // max(len(rows), 1))
        allocator.free(page_starts, distinct_pages=True, owner=owners, op="free_row_pages")
    else:
        allocator.free(page_starts, distinct_pages=True)


class ChunkCache(BasePrefixCache):
    """Prefix cache that caches nothing. `disable` is always True."""

    def __init__(self, req_to_token_pool: Any, allocator: Any, page_size: int,
                 device: Optional[torch.device | str] = None, count_protected: bool = False):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.device = torch.device(device if device is not None else allocator.device)
        self.count_protected = count_protected
        self._reported_protected = 0

    def protected_size(self) -> int:
        return self._reported_protected

    def tree_protected_size(self) -> int:
        return 0

    @property
    def disable(self) -> bool:
        return True

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Always empty (nothing is shared)."""
        return MatchResult(self.empty_indices(), None)

    def insert(self, key: RadixKey, value: Optional[torch.Tensor] = None) -> int:
        """Stores nothing; returns 0 (no slot of `value` is a duplicate)."""
        return 0

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        """Record the request's slots of `fill_ids` as its int64 `prefix_indices` (nothing freed).

        Writes `req.prefix_indices` only (the next chunk's prefix, as in SGLang)."""
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(req.fill_ids)]
        if self.count_protected:
            self._reported_protected += len(kv) - len(req.prefix_indices)
        req.kv.prefix_indices = kv.to(device=self.device, dtype=torch.int64, copy=True)

    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        """Free `req_to_token[row, :kv_allocated_len]` (partial last page included) and the row.

        The row holds only the request's own slots, position t at offset t % page_size of its
        page, so columns 0, ps, 2 ps, ... name each of its pages once.
        """
        if req.kv_freed:
            raise IntegrityError(f"cache_finished_req on request row {req.req_pool_idx} that was already freed")
        free_row_pages(self.req_to_token_pool, self.allocator, [req.req_pool_idx], req.kv_allocated_len)
        self.req_to_token_pool.free(req.req_pool_idx)
        if self.count_protected:
            self._reported_protected -= len(req.prefix_indices)
        req.kv.kv_freed = True  # the one request field this cache writes on finish (as SGLang)

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> int:
        return 0

    def dec_lock_ref(self, node: Any) -> int:
        return 0

    def reset(self) -> None:
        """Nothing cached; the reported protected size starts again from 0."""
        self._reported_protected = 0

    def check_integrity(self) -> IntegrityReport:
        """The cache holds no tokens; what it can get wrong is the page size it frees rows by."""
        ps, allocator_ps = self.page_size, self.allocator.page_size
        return IntegrityReport("chunk cache", [
            CheckResult("page size agrees with the allocator", ps == allocator_ps,
                        f"cache {ps}, allocator {allocator_ps}"),
        ])
