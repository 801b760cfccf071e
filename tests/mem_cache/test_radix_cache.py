"""RadixCache: exact tree state after inserts, matches, splits, locks and evictions."""

import numpy as np
import pytest
import torch

from memcli.errors import IntegrityError
from memcli.mem_cache.base_prefix_cache import RadixKey
from memcli.mem_cache.eviction import EVICTION_POLICIES
from memcli.mem_cache.radix_cache import EvictionRecord, RadixCache
from tests.mem_cache.fakes import FakeAllocator, tree_nodes


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class ClaimingCache(RadixCache):
    """Claims the pages of every inserted value from the fake allocator, so evictions free them."""

    def insert(self, key, value=None):
        new_len = len(key) - len(key) % self.page_size
        prefix_len = super().insert(key, value)
        if self.allocator is not None and value is not None and new_len > prefix_len:
            self.allocator.claim(value[prefix_len:new_len])
        return prefix_len


def make_cache(page_size=1, policy="lru", allocator=True, **kwargs):
    alloc = FakeAllocator(256, page_size) if allocator else None
    cache = ClaimingCache(None, alloc, page_size, eviction_policy=policy, **kwargs)
    cache.clock = Clock()
    return cache


def key(*ids, extra=None):
    return RadixKey(list(ids), extra)


def vals(*slots):
    return torch.tensor(slots, dtype=torch.int64)


def match(cache, *ids, extra=None):
    return cache.match_prefix(key(*ids, extra=extra)).device_indices.tolist()


def test_empty_cache():
    cache = make_cache(allocator=False)
    assert cache.device == torch.device("cpu")
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (0, 0, 0)
    result = cache.match_prefix(key(1, 2, 3))
    assert result.device_indices.dtype == torch.int64 and len(result.device_indices) == 0
    assert result.last_node is cache.root
    assert cache.evict(10) == 0


def test_insert_then_match():
    cache = make_cache(allocator=False)
    assert cache.insert(key(1, 2, 3), vals(10, 20, 30)) == 0
    assert (cache.total_size(), cache.evictable_size()) == (3, 3)
    assert match(cache, 1, 2, 3) == [10, 20, 30]
    assert match(cache, 1, 2) == [10, 20]
    assert match(cache, 1, 2, 3, 4) == [10, 20, 30]
    assert match(cache, 2, 3) == []
    assert cache.insert(key(4, 5), vals(40, 50)) == 0
    assert cache.total_size() == 5
    assert sorted(cache.all_values_flatten().tolist()) == [10, 20, 30, 40, 50]


def test_insert_without_value_stores_token_ids():
    cache = make_cache(allocator=False)
    assert cache.insert(key(7, 8, 9)) == 0
    assert match(cache, 7, 8, 9) == [7, 8, 9]


@pytest.mark.parametrize("page_size", [1, 2])
def test_splits(page_size):
    cache = make_cache(page_size, allocator=False)
    seq1 = [1, 2, 3, 4, 5, 6, 7, 8]
    cache.insert(RadixKey(seq1), torch.tensor(seq1) * 10)
    assert cache.insert(key(1, 2, 9, 10), vals(10, 20, 90, 100)) == 2
    assert cache.total_size() == 10
    assert cache.num_nodes == 3
    assert match(cache, 1, 2, 3, 4, 999, 1000) == [10, 20, 30, 40]
    assert cache.total_size() == 10
    assert cache.num_nodes == 4  # the match split [3..8] at 4
    assert match(cache, *seq1) == [10, 20, 30, 40, 50, 60, 70, 80]
    assert match(cache, 1, 2, 3, 4, 5, 6, 777, 888) == [10, 20, 30, 40, 50, 60]
    assert match(cache, 1, 2, 9, 10) == [10, 20, 90, 100]
    report = cache.check_integrity()
    failed = {c.name for c in report.failures}
    assert failed == (set() if page_size == 1 else {"page_layout"})  # values x10 are not paged slots


def test_split_mid_page_is_floored_to_the_page():
    cache = make_cache(4, allocator=False)
    cache.insert(key(*range(8)), torch.arange(8) + 4)
    assert match(cache, 0, 1, 2, 3, 4, 5, 99, 99) == [4, 5, 6, 7]
    assert [len(n.key) for n in cache._iter_nodes()] == [4, 4]


def test_key_shorter_than_a_page_matches_nothing():
    cache = make_cache(4, allocator=False)
    assert cache.insert(key(1, 2, 3), vals(4, 5, 6)) == 0
    assert cache.total_size() == 0
    assert cache.insert(key(1, 2, 3, 4, 5, 6), vals(4, 5, 6, 7, 8, 9)) == 0
    assert cache.total_size() == 4
    result = cache.match_prefix(key(1, 2, 3))
    assert len(result.device_indices) == 0 and result.last_node is cache.root
    assert match(cache, 1, 2, 3, 4, 5, 6, 7) == [4, 5, 6, 7]


@pytest.mark.parametrize("page_size, length, expected", [(1, 5, 5), (2, 5, 4), (4, 6, 4)])
def test_page_alignment(page_size, length, expected):
    cache = make_cache(page_size, allocator=False)
    cache.insert(key(*range(length)))
    assert len(cache.match_prefix(key(*range(length))).device_indices) == expected


def test_insert_returns_the_already_cached_length():
    cache = make_cache(allocator=False)
    cache.insert(key(1, 2, 3, 4), vals(10, 11, 12, 13))
    assert cache.insert(key(1, 2, 3, 4, 5, 6), vals(90, 91, 92, 93, 14, 15)) == 4
    assert match(cache, 1, 2, 3, 4, 5, 6) == [10, 11, 12, 13, 14, 15]
    assert cache.insert(key(1, 2, 3), vals(1, 2, 3)) == 3
    assert cache.total_size() == 6


def test_stored_values_do_not_keep_a_large_caller_array_alive():
    cache = make_cache(allocator=False)
    cache.insert(key(*range(10)), torch.arange(100, 110))
    big = torch.arange(200, 210)
    cache.insert(key(*range(9), 50), big)  # only the last token is new
    leaf = cache.match_prefix(key(*range(9), 50)).last_node
    assert leaf.value.tolist() == [209]
    assert leaf.value.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()


def test_extra_key_isolation():
    cache = make_cache(allocator=False)
    cache.insert(key(1, 2, 3, extra="key1"), vals(10, 20, 30))
    cache.insert(key(1, 2, 3, extra="key2"), vals(40, 50, 60))
    cache.insert(key(1, 2, 3), vals(70, 80, 90))
    assert match(cache, 1, 2, 3, extra="key1") == [10, 20, 30]
    assert match(cache, 1, 2, 3, extra="key2") == [40, 50, 60]
    assert match(cache, 1, 2, 3) == [70, 80, 90]
    assert match(cache, 1, 2, 3, extra="nonexistent") == []
    assert cache.total_size() == 9
    assert cache.check_integrity().ok


def test_hits_are_counted_on_every_node_a_match_passes():
    cache = make_cache(allocator=False)
    cache.insert(key(1, 2, 3, 4))
    cache.insert(key(1, 2, 7, 8))
    upper = cache.match_prefix(key(1, 2)).last_node
    cache.match_prefix(key(1, 2, 3, 4))
    cache.match_prefix(key(1, 2, 3, 9))
    leaf = cache.match_prefix(key(1, 2, 3, 4)).last_node
    assert upper.hit_count == 4
    assert leaf.hit_count == 2
    other = cache.match_prefix(key(1, 2, 7, 8)).last_node
    assert other.hit_count == 1 and upper.hit_count == 5


def test_lock_accounting():
    cache = make_cache(allocator=False)
    cache.insert(key(1, 2, 3))
    cache.insert(key(1, 2, 4, 5))
    node = cache.match_prefix(key(1, 2, 3)).last_node
    assert cache.inc_lock_ref(node) == -3
    assert (cache.evictable_size(), cache.protected_size()) == (2, 3)
    assert cache.inc_lock_ref(node) == 0
    sibling = cache.match_prefix(key(1, 2, 4, 5)).last_node
    assert cache.inc_lock_ref(sibling) == -2
    assert [node.parent.lock_ref, node.lock_ref, sibling.lock_ref] == [3, 2, 1]
    assert cache.check_integrity().ok
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 1
    assert cache.dec_lock_ref(sibling) == 4
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    assert cache.inc_lock_ref(cache.root) == 0 and cache.dec_lock_ref(cache.root) == 0
    assert cache.inc_lock_ref(None) == 0 and cache.dec_lock_ref(None) == 0


def test_unmatched_unlock_raises_and_changes_nothing():
    cache = make_cache(allocator=False)
    cache.insert(key(1, 2, 3))
    node = cache.match_prefix(key(1, 2, 3)).last_node
    with pytest.raises(IntegrityError, match="lock_ref is 0"):
        cache.dec_lock_ref(node)
    assert node.lock_ref == 0 and cache.evictable_size() == 3 and cache.protected_size() == 0


def test_locking_an_evicted_node_raises():
    cache = make_cache()
    cache.insert(key(1, 2), vals(1, 2))
    node = cache.match_prefix(key(1, 2)).last_node
    assert cache.evict(2) == 2
    with pytest.raises(IntegrityError, match="not in this tree"):
        cache.inc_lock_ref(node)


def test_split_of_a_locked_node_keeps_the_lock_on_both_halves():
    cache = make_cache(allocator=False)
    cache.insert(key(1, 2, 3, 4))
    node = cache.match_prefix(key(1, 2, 3, 4)).last_node
    cache.inc_lock_ref(node)
    cache.insert(key(1, 2, 9))
    upper = node.parent
    assert len(upper.key) == 2 and upper.lock_ref == 1 and node.lock_ref == 1
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    assert cache.check_integrity().ok
    cache.dec_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)


def insert_abc(cache):
    """Three disjoint 2-token sequences A, B, C inserted at t = 0, 1, 2 (slots = 2 * page)."""
    for t, (tokens, slots) in enumerate([((1, 1), (2, 3)), ((2, 2), (4, 5)), ((3, 3), (6, 7))]):
        cache.clock.now = float(t)
        cache.insert(key(*tokens), vals(*slots))


def eviction_order(cache, rounds=3):
    order = []
    for _ in range(rounds):
        cache.clock.now += 1
        cache.allocator.free_calls.clear()
        assert cache.evict(1) == 2
        order.append(cache.allocator.free_calls[0][0])
    return order


def test_lru_evicts_the_least_recently_used_first():
    cache = make_cache(2)
    insert_abc(cache)
    cache.clock.now = 3.0
    match(cache, 1, 1)
    assert eviction_order(cache) == [2, 3, 1]  # pages of B, C, A


def test_lfu_evicts_the_fewest_hits_first_ties_by_recency():
    cache = make_cache(2, "lfu")
    insert_abc(cache)
    for t, tokens in [(3, (2, 2)), (4, (2, 2)), (5, (3, 3)), (6, (1, 1))]:
        cache.clock.now = float(t)
        match(cache, *tokens)
    assert eviction_order(cache) == [3, 1, 2]  # C (1 hit, t5), A (1 hit, t6), B (2 hits)


def test_fifo_evicts_the_oldest_insert_first():
    cache = make_cache(2, "fifo")
    insert_abc(cache)
    for t in range(3, 6):
        cache.clock.now = float(t)
        match(cache, 1, 1)
    assert eviction_order(cache) == [1, 2, 3]


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid policies: belady, fifo, lfu, lru"):
        make_cache(policy="mru")
    assert set(EVICTION_POLICIES) == {"lru", "lfu", "fifo", "belady"}
    assert make_cache(policy="LRU").eviction_policy == "lru"


def test_evict_cascades_to_parents_and_skips_locked_leaves():
    cache = make_cache()
    cache.insert(key(1, 2, 3, 4), vals(1, 2, 3, 4))
    cache.insert(key(1, 2, 5, 6), vals(1, 2, 5, 6))
    cache.insert(key(7, 8), vals(7, 8))
    locked = cache.match_prefix(key(1, 2, 5, 6)).last_node
    cache.inc_lock_ref(locked)
    assert cache.evict(100) == 4  # [3,4] and [7,8]; [1,2] and [5,6] are locked
    assert sorted(cache.allocator.free_slot_ids().tolist()[-4:]) == [3, 4, 7, 8]
    assert cache.total_size() == 4 and cache.protected_size() == 4
    cache.dec_lock_ref(locked)
    assert cache.evict(1) == 2  # the leaf [5,6] first, whole node
    assert cache.evict(1) == 2  # then its parent [1,2], now a leaf
    assert cache.total_size() == 0 and cache.num_nodes == 0
    assert cache.check_integrity().ok


def test_eviction_log_reports_size_age_and_hits():
    cache = make_cache()
    cache.clock.now = 1.0
    cache.insert(key(1, 2, 3), vals(1, 2, 3))
    cache.clock.now = 2.0
    match(cache, 1, 2, 3)
    match(cache, 1, 2, 3)
    cache.clock.now = 10.0
    cache.evict(1)
    assert cache.eviction_log == [EvictionRecord(tokens=3, age=9.0, hit_count=2)]


def test_eviction_queue_stays_small_under_steady_pressure():
    cache = make_cache(allocator=False)
    for i in range(3000):
        cache.clock.now = float(i)
        cache.insert(key(i, i + 1, i + 2), torch.arange(3 * i, 3 * i + 3))
        match(cache, i, i + 1, i + 2)
        if cache.total_size() > 30:
            cache.evict(cache.total_size() - 30)
    assert cache.total_size() == 30
    assert len(cache._queue) <= 4 * cache.num_nodes + 1024
    assert cache.check_integrity().ok


def test_reset_forgets_everything():
    cache = make_cache(allocator=False)
    cache.insert(key(1, 2, 3))
    cache.reset()
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size(), cache.num_nodes) == (0, 0, 0, 0)
    assert match(cache, 1, 2, 3) == []


def test_disabled_cache_stores_nothing():
    cache = make_cache(allocator=False, disable=True)
    assert cache.insert(key(1, 2, 3)) == 0
    assert cache.total_size() == 0 and match(cache, 1, 2, 3) == []
    assert cache.evict(5) == 0


def test_values_live_on_the_allocator_device():
    cache = make_cache()
    cache.insert(key(1, 2), vals(5, 6))
    result = cache.match_prefix(key(1, 2))
    assert result.device_indices.device == cache.allocator.device
    assert np.shares_memory(cache.match_prefix(key(1, 2)).device_indices.numpy(), result.device_indices.numpy()) is False


def test_unified_leaf_keys_view_the_callers_tokens_only_where_they_cover_half_of_them():
    """A 0.5.23 leaf keeps a view of the tokens it was given when it covers at least half of
    the array they live in (a prompt, never rewritten), else a compact copy: the keys never
    keep more than twice the tree's tokens alive."""
    from memcli.mem_cache.radix_cache import _leaf_tokens

    prompt = np.arange(100, 120, dtype=np.int64)
    wide = _leaf_tokens(prompt[:16], 4, 16)  # 12 of the 20 tokens the prompt holds
    assert wide.tolist() == list(range(104, 116)) and np.shares_memory(wide, prompt)
    narrow = _leaf_tokens(prompt[:16], 10, 16)  # 6 of 20
    assert narrow.tolist() == list(range(110, 116)) and not np.shares_memory(narrow, prompt)
    foreign = np.frombuffer(prompt.tobytes(), dtype=np.int64)  # memory numpy does not own
    assert not np.shares_memory(_leaf_tokens(foreign, 0, 20), foreign)

    cache = make_cache(allocator=False, tree_stamps="unified")
    tokens = np.arange(500, 532, dtype=np.int64)
    cache.insert_unified(RadixKey(tokens[:24]), torch.arange(24), owned=True)
    cache.insert_unified(RadixKey(tokens), torch.arange(24, 32), 24, value_start=24, owned=True)  # 8 new of 32: copied
    first = cache.match_prefix(RadixKey(tokens[:24])).last_node
    second = cache.match_prefix(RadixKey(tokens)).last_node
    assert np.shares_memory(first.key, tokens) and first.key.tolist() == list(range(500, 524))
    assert not np.shares_memory(second.key, tokens) and second.key.tolist() == list(range(524, 532))


def _lock_state(cache):
    def path(node):
        tokens = []
        while node is not cache.root:
            tokens[:0] = list(node.key)
            node = node.parent
        return tuple(tokens)

    queued = {id(n) for n in cache._iter_nodes() if n.heap_seq in cache._queue.live_seqs()}
    return (sorted((path(n), n.lock_ref, id(n) in queued) for n in cache._iter_nodes()),
            cache.evictable_size(), cache.protected_size())


@pytest.mark.parametrize("old_path, new_path", [
    ((1, 2), (1, 2, 3, 4)),  # the lock moves down its path (a checkpoint)
    ((1, 2, 3, 4), (1, 2, 3, 4)),  # stays
    ((1, 2, 3, 4), (1, 2, 7)),  # to a sibling path: not a descendant
    ((1, 2, 7), (1, 2)),  # up: not a descendant
    (None, (1, 2, 3, 4)),  # from no lock
])
def test_move_lock_is_an_increment_then_a_decrement(old_path, new_path):
    states = []
    for moved in (False, True):
        cache = make_cache(allocator=False)
        cache.insert(key(1, 2))
        cache.insert(key(1, 2, 3, 4))
        cache.insert(key(1, 2, 7))
        old = None if old_path is None else cache.match_prefix(key(*old_path)).last_node
        new = cache.match_prefix(key(*new_path)).last_node
        cache.inc_lock_ref(old)
        cache.inc_lock_ref(cache.match_prefix(key(1, 2, 7)).last_node)  # another holder
        if moved:
            cache.move_lock(old, new)
        else:
            cache.inc_lock_ref(new)
            cache.dec_lock_ref(old)
        assert cache.check_integrity().ok
        states.append(_lock_state(cache))
    assert states[0] == states[1]


def test_move_lock_from_an_unlocked_node_raises_as_the_decrement_does():
    cache = make_cache(allocator=False)
    cache.insert(key(1, 2))
    cache.insert(key(5, 6))
    old, new = cache.match_prefix(key(1, 2)).last_node, cache.match_prefix(key(5, 6)).last_node
    with pytest.raises(IntegrityError, match="lock_ref is 0"):
        cache.move_lock(old, new)


def test_request_rows_are_read_through_numpy_on_a_cpu_and_follow_a_new_table():
    class Pool:
        req_to_token = torch.arange(12, dtype=torch.int32).reshape(3, 4)

    cache = RadixCache(Pool(), None, 1)
    row = cache._row(1)
    assert isinstance(row, np.ndarray) and row.tolist() == [4, 5, 6, 7]
    assert cache._row_slots(row, 1, 3).dtype == torch.int64 and cache._row_slots(row, 1, 3).tolist() == [5, 6]
    cache._write_row(row, 0, torch.tensor([40, 50], dtype=torch.int64))
    assert Pool.req_to_token[1].tolist() == [40, 50, 6, 7]  # a view: the table itself
    Pool.req_to_token = torch.zeros((3, 4), dtype=torch.int32)
    assert cache._row(1).tolist() == [0, 0, 0, 0]


def _tree_state(cache):
    """Every node (`tree_nodes`), the root's stamp, then the order the leaves would be evicted in."""
    nodes, root = tree_nodes(cache), cache.root.last_access_time
    order = []
    while (leaf := cache._queue.pop()) is not None:
        order.append(leaf.key.tolist())
    return nodes, root, order


@pytest.mark.parametrize("semantics", [{}, {"tree_stamps": "unified", "lru_clock": "logical", "split_stamp": "refresh"},
                                       {"lru_clock": "logical", "count_hits": True}])
def test_touch_prefix_walks_as_a_match_does(semantics):
    """The waiting-prefix refresh touches without joining slots: the same stamps, hits, splits
    and eviction order as a match whose result is dropped."""
    trees = []
    for touch in (False, True):
        cache = make_cache(page_size=2, allocator=False, **semantics)
        cache.insert(key(1, 2, 3, 4, 5, 6), vals(10, 20, 30, 40, 50, 60))
        cache.insert(key(1, 2, 7, 8), vals(11, 21, 70, 80))
        cache.insert(key(9, 9), vals(90, 91))
        for ids in ((1, 2, 3, 4, 9), (9, 9, 9), (1, 2), (5, 6), (1, 2, 3, 4, 5, 6, 7)):  # the first splits a node
            cache.clock.now += 1.0
            if touch:
                assert cache.touch_prefix(key(*ids)) is None
            else:
                cache.match_prefix(key(*ids))
        trees.append(_tree_state(cache))
    assert len(trees[0][0]) == 5  # the split's upper node is there
    assert trees[1] == trees[0]
