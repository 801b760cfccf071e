"""NullCache: the tree cache of benchmarks that only exercise allocation.

Caches nothing and never evicts, but frees a finished request's slots and row so a
benchmark can run many rounds. Takes the config's page size like every other component.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from rich.text import Text
from rich.tree import Tree

from memcli.errors import IntegrityError
from memcli.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult, RadixKey
from memcli.mem_cache.integrity import IntegrityReport


class NullCache(BasePrefixCache):
    """No-op prefix cache: empty matches, sizes 0, `evict` frees nothing and returns 0."""

    def __init__(self, allocator: Any, req_to_token_pool: Any, page_size: int):
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.page_size = page_size
        self.device = torch.device(allocator.device)

    @property
    def disable(self) -> bool:
        return True

    def match_prefix(self, key: RadixKey) -> MatchResult:
        return MatchResult(self.empty_indices(), None)

    def insert(self, key: RadixKey, value: Optional[torch.Tensor] = None) -> int:
        return 0

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        """Record the request's slots of `fill_ids` as its int64 `prefix_indices`."""
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(req.fill_ids)]
        req.prefix_indices = kv.to(device=self.device, dtype=torch.int64, copy=True)

    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        """Free `req_to_token[row, :kv_allocated_len]` and the row, once."""
        if req.kv_freed:
            raise IntegrityError(f"cache_finished_req on request row {req.req_pool_idx} that was already freed")
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_allocated_len]
        if len(kv):
            self.allocator.free(kv.to(torch.int64))
        self.req_to_token_pool.free(req.req_pool_idx)
        req.kv_freed = True

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> int:
        return 0

    def dec_lock_ref(self, node: Any) -> int:
        return 0

    def reset(self) -> None:
        """Nothing to forget."""

    def check_integrity(self) -> IntegrityReport:
        return IntegrityReport("null cache", [])

    def pretty_print(self) -> Tree:
        return Tree(Text(f"null cache (caches nothing)  page_size={self.page_size}"))
