"""Belady's eviction in the radix cache: the leaf whose first page is next used furthest in
the future goes first, read through the future's handles (a fake future here)."""

from __future__ import annotations

import numpy as np
import pytest

from memcli.mem_cache.radix_cache import RadixCache
from tests.mem_cache.test_radix_cache import ClaimingCache, Clock, key, match, vals
from tests.mem_cache.fakes import FakeAllocator


class ListFuture:
    """A handle is the path's tokens; `uses` maps a path to the requests (trace order) whose
    prompt holds it. `admitted` moves the boundary like the replay does."""

    def __init__(self, uses: dict[tuple, list[int]]):
        self.uses = uses
        self.admitted: set[int] = set()

    def start(self, extra_key):
        return ()

    def advance(self, handle, tokens):
        return handle + tuple(np.asarray(tokens).tolist())

    def next_use(self, handle):
        return min((j for j in self.uses.get(handle, ()) if j not in self.admitted), default=None)

    def last_use(self, handle):
        return max((j for j in self.uses.get(handle, ()) if j in self.admitted), default=None)

    def last_and_next_use(self, handle):
        return self.last_use(handle), self.next_use(handle)


def make_belady(future, page_size=1):
    cache = ClaimingCache(None, FakeAllocator(256, page_size), page_size, eviction_policy="belady")
    cache.clock = Clock()
    cache.future = future
    return cache


def evicted_first_tokens(cache, n):
    order = []
    for _ in range(n):
        before = {tuple(node.key[:1].tolist()) for node in cache._iter_nodes()}
        cache.evict(1)
        after = {tuple(node.key[:1].tolist()) for node in cache._iter_nodes()}
        order += sorted(before - after)
    return order


def test_the_leaf_next_used_furthest_goes_first_and_unused_before_all():
    # Three leaves under the root: (1, 2) next used by request 5, (3, 4) never again, (5, 6) by request 2.
    future = ListFuture({(1,): [5], (3,): [], (5,): [2]})
    cache = make_belady(future)
    for t, ids in enumerate(((1, 2), (3, 4), (5, 6))):
        cache.clock.now = float(t)
        cache.insert(key(*ids), vals(*(10 * t + i for i in range(1, 3))))
    assert evicted_first_tokens(cache, 3) == [(3,), (1,), (5,)]


def test_an_admitted_request_no_longer_counts_as_a_future_use():
    future = ListFuture({(1,): [3, 9], (5,): [4]})
    cache = make_belady(future)
    cache.insert(key(1, 2), vals(1, 2))
    cache.insert(key(5, 6), vals(3, 4))
    # Request 3 is admitted and matches (1, 2): its next use is now request 9, after request 4's.
    future.admitted.add(3)
    match(cache, 1, 2)
    assert evicted_first_tokens(cache, 1) == [(1,)]


def test_a_split_tail_is_judged_by_its_own_first_page():
    # (1, 2, 3, 4) is one node; splitting at 2 leaves the tail (3, 4), whose first page nobody uses.
    future = ListFuture({(1,): [7], (1, 2, 3): [], (1, 2): [7], (9,): [8]})
    cache = make_belady(future)
    cache.insert(key(1, 2, 3, 4), vals(1, 2, 3, 4))
    cache.insert(key(9, 9), vals(5, 6))
    match(cache, 1, 2, 7)  # splits (1, 2 | 3, 4)
    assert [node.key.tolist() for node in cache._iter_nodes() if not node.children] in ([[3, 4], [9, 9]], [[9, 9], [3, 4]])
    assert evicted_first_tokens(cache, 1) == [(3,)]  # the tail goes first: never used again


def test_eviction_records_carry_the_last_and_next_use():
    future = ListFuture({(1,): [0, 4]})
    future.admitted.add(0)
    cache = make_belady(future)
    cache.insert(key(1, 2), vals(1, 2))
    cache.evict(2)
    (record,) = cache.eviction_log
    assert (record.tokens, record.last_use, record.next_use) == (2, 0, 4)


def test_belady_without_a_future_refuses_to_rank():
    cache = ClaimingCache(None, FakeAllocator(16), 1, eviction_policy="belady")
    with pytest.raises(ValueError, match="needs the trace's future"):
        cache.insert(key(1, 2), vals(1, 2))


def test_paged_first_page_is_a_whole_page():
    # Page size 2: the node (1, 2, 3, 4)'s first page is (1, 2).
    future = ListFuture({(1, 2): [6], (7, 8): [1]})
    cache = make_belady(future, page_size=2)
    cache.insert(key(1, 2, 3, 4), vals(2, 3, 4, 5))
    cache.insert(key(7, 8), vals(6, 7))
    assert evicted_first_tokens(cache, 1) == [(1,)]
    assert isinstance(cache, RadixCache)
