"""KV events: one per page, hashes chained to the previous page (also across nodes)."""

import pytest
import torch

from memcli.mem_cache.base_prefix_cache import RadixKey
from memcli.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, page_hash
from memcli.mem_cache.radix_cache import RadixCache
from tests.mem_cache.fakes import FakeAllocator


def make(page_size, events=True):
    allocator = FakeAllocator(64, page_size)
    return RadixCache(None, allocator, page_size, kv_events=events)


def insert(cache, tokens, extra=None):
    slots = cache.allocator.alloc(len(tokens))
    prefix_len = cache.insert(RadixKey(tokens, extra), slots)
    aligned = len(tokens) - len(tokens) % cache.page_size
    for part in (slots[:prefix_len], slots[aligned:]):
        if len(part):
            cache.allocator.free(part)


def test_no_events_when_disabled():
    cache = make(1, events=False)
    insert(cache, [1, 2, 3])
    cache.reset()
    assert cache.take_events() == []


@pytest.mark.parametrize("page_size", [1, 2])
def test_one_stored_event_per_page_chained(page_size):
    cache = make(page_size)
    insert(cache, [1, 2, 3, 4, 5])
    events = cache.take_events()
    assert all(isinstance(e, BlockStored) for e in events)
    assert len(events) == 4 // page_size + (page_size == 1)
    assert events[0].parent_block_hash is None
    for prev, event in zip(events, events[1:]):
        assert event.parent_block_hash == prev.block_hashes[0]
    assert all(len(e.token_ids) == e.block_size == page_size and len(e.block_hashes) == 1 for e in events)
    assert cache.take_events() == []


def test_chain_continues_across_nodes_and_splits_emit_nothing():
    cache = make(2)
    insert(cache, [1, 2, 3, 4])
    first = cache.take_events()
    insert(cache, [1, 2, 3, 4, 5, 6])
    (extension,) = cache.take_events()
    assert extension.parent_block_hash == first[1].block_hashes[0]
    assert extension.token_ids == (5, 6)
    insert(cache, [1, 2, 9, 9])  # splits [1,2,3,4] -> [1,2] + [3,4]: no page changes
    (branch,) = cache.take_events()
    assert branch.parent_block_hash == first[0].block_hashes[0]
    assert branch.token_ids == (9, 9)


def test_equal_pages_at_different_positions_hash_differently():
    cache = make(4)
    insert(cache, [1, 2, 3, 4, 1, 2, 3, 4])
    a, b = cache.take_events()
    assert a.block_hashes != b.block_hashes
    assert b.parent_block_hash == a.block_hashes[0]
    assert a.block_hashes[0] == page_hash(None, None, torch.tensor([1, 2, 3, 4]).numpy())


def test_extra_key_changes_the_hash():
    cache = make(2)
    insert(cache, [1, 2], extra="lora")
    insert(cache, [1, 2])
    a, b = cache.take_events()
    assert a.extra_key == "lora" and b.extra_key is None
    assert a.block_hashes != b.block_hashes


def test_eviction_removes_every_stored_page():
    cache = make(2)
    insert(cache, [1, 2, 3, 4])
    insert(cache, [1, 2, 5, 6])
    stored = {e.block_hashes[0] for e in cache.take_events()}
    assert cache.evict(100) == 6
    removed = cache.take_events()
    assert all(isinstance(e, BlockRemoved) and len(e.block_hashes) == 1 for e in removed)
    assert {e.block_hashes[0] for e in removed} == stored and len(removed) == 3


def test_reset_clears_all_after_the_pending_events():
    cache = make(1)
    assert cache.take_events() == []  # construction emits nothing
    insert(cache, [1, 2])
    cache.reset()
    events = cache.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored, AllBlocksCleared]
    cache.reset()
    assert cache.take_events() == [AllBlocksCleared()]


def test_snapshot_matches_the_replayed_events():
    cache = make(2)
    for tokens in ([1, 2, 3, 4], [1, 2, 5, 6, 7, 8], [9, 9], [1, 2, 3, 4, 4, 4]):
        insert(cache, tokens)
    cache.match_prefix(RadixKey([1, 2, 5, 6, 0, 0]))  # a split
    replayed = {e.block_hashes[0]: e for e in cache.take_events()}
    snapshot = cache.snapshot_events()
    assert len(snapshot) == cache.total_size() // 2
    assert {e.block_hashes[0]: e for e in snapshot} == replayed
