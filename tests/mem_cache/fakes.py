"""Test doubles for the prefix-cache tests: a paged allocator, a request table, a request.

They follow the interfaces the real classes offer (see memcli.mem_cache.base_prefix_cache)
and are strict: a double free or a free of an unallocated page raises at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch


class DoubleFree(AssertionError):
    pass


class FakeAllocator:
    """Pages 1..size/page_size (page 0 is never handed out). `free` frees whole pages."""

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu"):
        assert size % page_size == 0
        self.size = size
        self.page_size = page_size
        self.device = torch.device(device)
        self.free_pages: list[int] = list(range(1, size // page_size + 1))
        self.free_calls: list[list[int]] = []

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc_pages(self, num_pages: int) -> list[int]:
        if num_pages > len(self.free_pages):
            raise MemoryError(f"need {num_pages} pages, {len(self.free_pages)} free")
        pages, self.free_pages = self.free_pages[:num_pages], self.free_pages[num_pages:]
        return pages

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """Slots for `num_tokens` positions starting at a page boundary (paged layout)."""
        pages = self.alloc_pages(-(-num_tokens // self.page_size))
        slots = [p * self.page_size + k for p in pages for k in range(self.page_size)]
        return torch.tensor(slots[:num_tokens], dtype=torch.int64, device=self.device)

    def claim(self, slots) -> torch.Tensor:
        """Mark the pages of the given slots allocated (tests that pick slot ids by hand)."""
        slots = torch.as_tensor(slots, dtype=torch.int64)
        for page in sorted(set((slots // self.page_size).tolist())):
            self.free_pages.remove(page)
        return slots

    def free(self, indices: torch.Tensor, distinct_pages: bool = False) -> None:
        assert not indices.dtype.is_floating_point, indices.dtype
        pages = sorted(set((indices.reshape(-1).to(torch.int64) // self.page_size).tolist()))
        if distinct_pages:
            assert len(pages) == indices.numel(), f"{indices.numel()} slots name only {len(pages)} pages"
        free = set(self.free_pages)
        for page in pages:
            if page in free or page == 0:
                raise DoubleFree(f"page {page} freed while free (slots {indices.tolist()[:8]})")
        self.free_calls.append(pages)
        self.free_pages.extend(pages)

    def free_slot_ids(self) -> torch.Tensor:
        pages = torch.tensor(self.free_pages, dtype=torch.int64, device=self.device)
        return (pages[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)).flatten()


class FakeReqToTokenPool:
    def __init__(self, rows: int, cols: int, device: str = "cpu"):
        self.req_to_token = torch.zeros((rows, cols), dtype=torch.int32, device=device)
        self.free_rows = list(range(rows))

    def alloc(self) -> int:
        return self.free_rows.pop(0)

    def free(self, row: int) -> None:
        if row in self.free_rows:
            raise DoubleFree(f"request row {row} freed twice")
        self.free_rows.append(row)


@dataclass
class FakeReq:
    origin_input_ids: np.ndarray
    output_ids: list[int] = field(default_factory=list)
    extra_key: Optional[str] = None
    fill_ids: np.ndarray = None
    req_pool_idx: Optional[int] = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    last_matched_prefix_len: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    kv_freed: bool = False
    cache_inserted_len: int = 0  # 0.5.23: the longest prefix its checkpoints inserted

    def __post_init__(self):
        self.origin_input_ids = np.asarray(self.origin_input_ids, dtype=np.int64)
        if self.fill_ids is None:
            self.fill_ids = self.origin_input_ids

    @property
    def input_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def kv(self) -> "FakeReq":
        """The memory record is the fake itself (memory writes `req.kv.<field>`)."""
        return self

    def token_ids(self, n: int) -> np.ndarray:
        all_ids = np.concatenate([self.origin_input_ids, np.asarray(self.output_ids, dtype=np.int64)])
        return all_ids[:n]


class Harness:
    """A tree cache with its allocator and table, and the request steps a scheduler takes."""

    def __init__(self, cache_cls, size: int = 256, page_size: int = 1, rows: int = 8, cols: int = 128, **kwargs):
        self.allocator = FakeAllocator(size, page_size)
        self.pool = FakeReqToTokenPool(rows, cols)
        self.page_size = page_size
        if cache_cls.__name__ == "NullCache":
            self.cache = cache_cls(self.allocator, self.pool, page_size)
        else:
            self.cache = cache_cls(self.pool, self.allocator, page_size, **kwargs)
        self.running: list[FakeReq] = []

    def admit(self, req: FakeReq) -> None:
        """Match (at most len - 1 tokens), lock, take a row, write the prefix into it."""
        from memcli.mem_cache.base_prefix_cache import RadixKey

        req.fill_ids = req.token_ids(len(req.origin_input_ids) + len(req.output_ids))
        match = self.cache.match_prefix(RadixKey(req.fill_ids[: len(req.fill_ids) - 1], req.extra_key))
        req.prefix_indices, req.last_node = match.device_indices, match.last_node
        req.last_matched_prefix_len = len(match.device_indices)
        self.cache.inc_lock_ref(req.last_node)
        req.req_pool_idx = self.pool.alloc()
        prefix_len = len(req.prefix_indices)
        self.pool.req_to_token[req.req_pool_idx, :prefix_len] = req.prefix_indices.to(torch.int32)
        req.kv_allocated_len = req.kv_committed_len = prefix_len
        req.kv_freed = False
        self.running.append(req)

    def extend(self, req: FakeReq, new_len: int) -> None:
        """Allocate positions [kv_allocated_len, new_len) in paged layout and compute them."""
        ps, row = self.page_size, self.pool.req_to_token[req.req_pool_idx]
        pos = req.kv_allocated_len
        while pos < new_len:
            if pos % ps == 0:
                row[pos] = self.allocator.alloc_pages(1)[0] * ps
            else:
                row[pos] = row[pos - 1] + 1
            pos += 1
        req.kv_allocated_len = req.kv_committed_len = new_len

    def prefill(self, req: FakeReq, upto: int) -> None:
        """One prefill round (a chunk when upto < len): compute, then cache_unfinished_req."""
        req.fill_ids = req.token_ids(upto)
        self.extend(req, upto)
        self.cache.cache_unfinished_req(req)

    def decode(self, req: FakeReq, token: int) -> None:
        """Sample `token`; then allocate and compute the KV of the previous last token."""
        req.output_ids.append(token)
        self.extend(req, len(req.origin_input_ids) + len(req.output_ids) - 1)

    def finish(self, req: FakeReq, is_insert: bool = True) -> None:
        self.cache.cache_finished_req(req, is_insert=is_insert)
        self.running.remove(req)

    def held_tokens(self) -> int:
        """Tokens (whole pages) that running requests own."""
        ps = self.page_size
        return sum((-(-r.kv_allocated_len // ps) - r.last_matched_prefix_len // ps) * ps for r in self.running)

    def assert_conserved(self) -> None:
        available, total = self.allocator.available_size(), self.cache.total_size()
        held = self.held_tokens()
        assert available + total + held == self.allocator.size, (
            f"available {available} + tree {total} + held {held} != size {self.allocator.size}")
        self.cache.check_integrity().raise_if_failed()


def tree_nodes(cache: Any) -> list[tuple]:
    """Every node of `cache`'s tree but the root, parents first: its key, slots, stamps, hit
    count, lock and its parent's place in this list (-1: the root)."""
    order = {id(cache.root): -1}
    nodes = []
    for n in cache._iter_nodes():
        order[id(n)] = len(order) - 1
        nodes.append((n.key.tolist(), n.value.tolist(), n.last_access_time, n.creation_time, n.hit_count,
                      n.lock_ref, order[id(n.parent)]))
    return nodes
