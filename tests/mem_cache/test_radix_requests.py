"""cache_unfinished_req / cache_finished_req: every slot accounted for, freed exactly once.

The fake allocator raises on a double free, and `assert_conserved` checks after each step
that available + tree + held by running requests == pool size.
"""

import numpy as np
import pytest
import torch

from memcli.errors import IntegrityError
from memcli.mem_cache.base_prefix_cache import RadixKey
from memcli.mem_cache.radix_cache import RadixCache
from tests.mem_cache.fakes import FakeReq, Harness, tree_nodes

PAGE_SIZES = [1, 4]


def prompt(n, start=100):
    return np.arange(start, start + n, dtype=np.int64)


def tree_slots(h, req, n):
    return h.cache.match_prefix(RadixKey(req.token_ids(n), req.extra_key)).device_indices.tolist()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_prefill_decode_finish(ps):
    h = Harness(RadixCache, page_size=ps)
    req = FakeReq(prompt(10))
    h.admit(req)
    h.prefill(req, 10)
    aligned = 10 // ps * ps
    assert req.last_matched_prefix_len == aligned
    assert len(req.prefix_indices) == 10 and req.prefix_indices.dtype == torch.int64
    assert req.prefix_indices.tolist() == h.pool.req_to_token[req.req_pool_idx, :10].tolist()
    assert h.cache.protected_size() == aligned
    h.assert_conserved()
    for token in (1, 2, 3):
        h.decode(req, token)
        h.assert_conserved()
    h.finish(req)
    assert req.kv_freed
    committed = req.kv_committed_len // ps * ps
    assert h.cache.total_size() == committed and h.cache.protected_size() == 0
    assert h.allocator.available_size() + h.cache.evictable_size() == h.allocator.size
    assert len(h.pool.free_rows) == 8
    h.assert_conserved()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_second_request_reuses_the_prefix(ps):
    h = Harness(RadixCache, page_size=ps)
    first = FakeReq(prompt(12))
    h.admit(first)
    h.prefill(first, 12)
    h.finish(first)
    second = FakeReq(np.concatenate([prompt(9), [7, 7, 7]]))
    h.admit(second)
    assert len(second.prefix_indices) == 9 // ps * ps
    assert second.prefix_indices.tolist() == tree_slots(h, second, 9 // ps * ps)
    h.prefill(second, 12)
    h.decode(second, 5)
    h.assert_conserved()
    h.finish(second)
    h.assert_conserved()
    assert h.cache.protected_size() == 0


@pytest.mark.parametrize("stamps", ["radix", "unified"])
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_chunked_prefill_keeps_the_partial_page_with_the_request(ps, stamps):
    """Each chunk's checkpoint: the next round's prefix is the tree's slots of the aligned part
    and the request's own partial page (0.5.5's insert and re-match, 0.5.23's checkpoint)."""
    h = Harness(RadixCache, page_size=ps, tree_stamps=stamps)
    req = FakeReq(prompt(11))
    h.admit(req)
    for upto in (3, 6, 9, 11):
        h.prefill(req, upto)
        aligned = upto // ps * ps
        assert req.last_matched_prefix_len == aligned
        assert len(req.prefix_indices) == upto
        assert req.prefix_indices[:aligned].tolist() == tree_slots(h, req, aligned)
        assert h.cache.total_size() == aligned and h.cache.protected_size() == aligned
        h.assert_conserved()
    h.finish(req)
    h.assert_conserved()


@pytest.mark.parametrize("stamps", ["radix", "unified"])
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_two_identical_requests_in_flight_free_their_duplicates(ps, stamps):
    """B computed the same tokens as A; after B's rounds its row points at A's (tree) slots."""
    h = Harness(RadixCache, page_size=ps, tree_stamps=stamps)
    a, b = FakeReq(prompt(12)), FakeReq(prompt(12))
    h.admit(a)
    h.admit(b)
    for upto in (6, 10, 12):
        h.prefill(a, upto)
        h.prefill(b, upto)
        aligned = upto // ps * ps
        row_a = h.pool.req_to_token[a.req_pool_idx, :aligned].tolist()
        row_b = h.pool.req_to_token[b.req_pool_idx, :aligned].tolist()
        assert row_a == row_b == tree_slots(h, a, aligned)
        assert b.prefix_indices[:aligned].tolist() == row_b
        assert b.prefix_indices[aligned:].tolist() == h.pool.req_to_token[b.req_pool_idx, aligned:upto].tolist()
        assert b.prefix_indices.dtype == torch.int64
        h.assert_conserved()
    h.decode(a, 1)
    h.decode(b, 1)
    h.finish(a)
    h.finish(b)
    h.assert_conserved()
    assert h.cache.total_size() == 12 // ps * ps
    assert h.allocator.available_size() + h.cache.total_size() == h.allocator.size


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_finish_inserts_what_another_request_cached_meanwhile_as_duplicates(ps):
    h = Harness(RadixCache, page_size=ps)
    a, b = FakeReq(prompt(9)), FakeReq(prompt(9))
    h.admit(a)
    h.admit(b)
    h.prefill(a, 9)
    h.extend(b, 9)  # b computed the same tokens but has not cached them yet
    h.finish(a)
    h.finish(b)  # its first 8 (or 9) tokens are duplicates: freed
    h.assert_conserved()
    assert h.cache.total_size() == 9 // ps * ps


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_finish_frees_allocated_but_uncommitted_slots(ps):
    h = Harness(RadixCache, page_size=ps)
    req = FakeReq(prompt(7))
    h.admit(req)
    h.prefill(req, 7)
    h.decode(req, 1)
    h.extend(req, 9)  # one slot beyond what is committed
    req.kv_committed_len = 8
    h.finish(req)
    h.assert_conserved()
    assert h.cache.total_size() == 8 // ps * ps


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_retraction_frees_the_request_slots_without_inserting(ps):
    h = Harness(RadixCache, page_size=ps)
    first = FakeReq(prompt(8))
    h.admit(first)
    h.prefill(first, 8)
    h.finish(first)
    req = FakeReq(np.concatenate([prompt(8), [5, 6, 7]]))
    h.admit(req)
    h.prefill(req, 10)
    h.decode(req, 9)
    total = h.cache.total_size()
    h.finish(req, is_insert=False)
    h.assert_conserved()
    assert h.cache.total_size() == total
    assert h.cache.protected_size() == 0
    assert h.allocator.available_size() + h.cache.total_size() == h.allocator.size


def test_finishing_twice_raises():
    h = Harness(RadixCache, page_size=1)
    req = FakeReq(prompt(4))
    h.admit(req)
    h.prefill(req, 4)
    h.finish(req)
    with pytest.raises(IntegrityError, match="already freed"):
        h.cache.cache_finished_req(req)


def test_extra_key_requests_do_not_share():
    h = Harness(RadixCache, page_size=1)
    a = FakeReq(prompt(6), extra_key="lora-a")
    h.admit(a)
    h.prefill(a, 6)
    h.finish(a)
    b = FakeReq(prompt(6), extra_key="lora-b")
    h.admit(b)
    assert len(b.prefix_indices) == 0
    h.prefill(b, 6)
    h.finish(b)
    assert h.cache.total_size() == 12
    h.assert_conserved()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_disabled_radix_frees_everything(ps):
    h = Harness(RadixCache, page_size=ps, disable=True)
    req = FakeReq(prompt(10))
    h.admit(req)
    h.prefill(req, 6)
    assert req.prefix_indices.tolist() == h.pool.req_to_token[req.req_pool_idx, :6].tolist()
    h.prefill(req, 10)
    h.decode(req, 3)
    h.finish(req)
    assert h.cache.total_size() == 0
    assert h.allocator.available_size() == h.allocator.size


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_eviction_while_requests_run(ps):
    h = Harness(RadixCache, size=64, page_size=ps)
    for i in range(6):
        req = FakeReq(prompt(10, start=1000 * i))
        h.admit(req)
        h.prefill(req, 10)
        h.finish(req)
    running = FakeReq(prompt(10, start=0))
    h.admit(running)
    h.prefill(running, 10)
    evictable = h.cache.evictable_size()
    assert h.cache.evict(h.allocator.size) == evictable
    assert h.cache.evictable_size() == 0
    assert h.cache.protected_size() == 10 // ps * ps
    h.assert_conserved()
    h.finish(running)
    h.assert_conserved()


def test_a_prefix_evicted_without_a_lock_is_reported():
    h = Harness(RadixCache, page_size=1)
    first = FakeReq(prompt(8))
    h.admit(first)
    h.prefill(first, 8)
    h.finish(first)
    req = FakeReq(prompt(10))
    h.admit(req)
    h.cache.dec_lock_ref(req.last_node)  # a buggy caller drops the admission lock ...
    h.cache.evict(100)  # ... and the prefix goes
    h.extend(req, 10)
    req.last_node = None
    with pytest.raises(IntegrityError, match="prefix of 8 tokens is no longer cached"):
        h.cache.cache_finished_req(req)


def _snapshot(h):
    """The tree (key, slots, stamps, hits, locks of every node, parents first), the free list
    and the rows: everything a checkpoint writes."""
    return tree_nodes(h.cache), sorted(h.allocator.free_pages), h.pool.req_to_token.tolist()


@pytest.mark.parametrize("stamps", ["radix", "unified"])
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_checkpoints_that_skip_the_locked_prefix_compare_walk_as_the_compare(ps, stamps, monkeypatch):
    """A checkpoint walks its locked prefix without comparing tokens (0.5.5's insert and the
    re-match of what it just inserted, 0.5.23's insert and the prompt's second insert:
    `on_path`): the same tree, stamps, hits, locks, frees and rows as the walk that compares
    every node. Requests run two at a time, the second sharing part of the first's new
    tokens, so checkpoints meet nodes that leave their tokens mid-node."""
    rng = np.random.default_rng(3)
    base = prompt(40)
    pairs = []
    for i in range(5):
        first = np.concatenate([base[: rng.integers(0, 40)], prompt(int(rng.integers(6, 16)), 500 + 40 * i)])
        shared = int(rng.integers(1, len(first)))
        second = np.concatenate([first[:shared], prompt(int(rng.integers(2, 12)), 520 + 40 * i)])
        pairs.append((first, second))

    def run(compare_all):
        if compare_all:
            for name in ("insert_unified", "insert", "_walk"):
                walk = getattr(RadixCache, name)
                monkeypatch.setattr(RadixCache, name,
                                    lambda self, *a, _walk=walk, on_path=0, **k: _walk(self, *a, on_path=0, **k))
        unified = {"prompt_split": "prompt", "insert_hits": True} if stamps == "unified" else {}
        h = Harness(RadixCache, page_size=ps, size=1024, tree_stamps=stamps, lru_clock="logical", **unified)
        snapshots = []
        for i, tokens in enumerate(pairs):
            reqs = [FakeReq(t) for t in tokens]
            for req in reqs:
                h.admit(req)
            for chunk in (0, 1):  # two chunks each, interleaved
                for req in reqs:
                    n = len(req.origin_input_ids)
                    h.prefill(req, (len(req.prefix_indices) + n) // 2 if chunk == 0 else n)
                    snapshots.append(_snapshot(h))
            for token in range(3):
                for j, req in enumerate(reqs):
                    h.decode(req, 9000 + 100 * i + 10 * j + token)
            for req in reqs:
                h.finish(req)
                h.assert_conserved()
                snapshots.append(_snapshot(h))
        monkeypatch.undo()
        return snapshots

    assert run(compare_all=False) == run(compare_all=True)
