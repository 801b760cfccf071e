"""HiRadixCache on tiny pools: exact slots, host slots, locks and sizes after each operation."""

import math

import pytest
import torch

from memcli.errors import IntegrityError
from memcli.mem_cache.allocator import make_allocator
from memcli.mem_cache.base_prefix_cache import RadixKey
from memcli.mem_cache.cache_controller import CacheController
from memcli.mem_cache.hiradix_cache import HiRadixCache
from memcli.mem_cache.host_pool import HostKVPool


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(write_policy="write_through", size=32, host=64, page_size=1, bandwidth=math.inf, latency=0.0,
         threshold=10, floor="above_device"):
    allocator = make_allocator(size, page_size, torch.device("cpu"), "torch")
    host_pool = HostKVPool(host, page_size, 1, 1, 4, "float32")  # 32 bytes per token
    controller = CacheController(allocator, host_pool, write_policy, host_pool.bytes_per_token, bandwidth, latency)
    cache = HiRadixCache(None, allocator, page_size, host_pool, write_policy=write_policy,
                         load_back_threshold=threshold, controller=controller, host_floor=floor,
                         lru_clock="logical", split_stamp="refresh")
    clock = Clock()
    cache.clock = clock
    return cache, allocator, host_pool, clock


def insert(cache, allocator, tokens, chunked=False):
    slots = allocator.alloc(len(tokens))
    prefix = cache.insert(RadixKey(tokens), slots, chunked=chunked)
    allocator.free(slots[:prefix])
    return slots


def assert_ok(cache):
    report = cache.check_integrity()
    assert report.ok, [c.detail for c in report.failures]


def test_write_through_backs_up_on_insert_and_unlocks_on_ack():
    cache, alloc, host, clock = make()
    insert(cache, alloc, list(range(12)))
    node = cache.root.children[0]
    assert node.host_value.tolist() == list(range(12)) and node.lock_ref == 1
    assert cache.protected_size() == 12 and cache.host_size() == 12 and host.available_size() == 52
    cache.check_hicache_events()
    assert node.lock_ref == 0 and cache.evictable_size() == 12
    assert_ok(cache)


def test_write_through_selective_needs_a_second_hit_and_chunks_count_none():
    cache, alloc, host, clock = make("write_through_selective")
    insert(cache, alloc, list(range(12)))
    insert(cache, alloc, list(range(12)), chunked=True)
    assert cache.host_size() == 0 and cache.root.children[0].hit_count == 1
    insert(cache, alloc, list(range(12)))
    assert cache.host_size() == 12 and cache.root.children[0].hit_count == 2
    assert_ok(cache)


def test_eviction_keeps_backed_up_nodes_and_deletes_the_others():
    cache, alloc, host, clock = make("write_through_selective")
    insert(cache, alloc, list(range(12)))
    insert(cache, alloc, list(range(12)))  # backed up (second hit)
    insert(cache, alloc, [100] * 12)  # not backed up
    cache.check_hicache_events()
    assert cache.evict(24) == 24
    assert sorted(cache.root.children) == [0]  # [100] * 12 deleted, [0..11] kept as host-only
    kept = cache.root.children[0]
    assert kept.value is None and kept.host_value.tolist() == list(range(12))
    assert cache.total_size() == 0 and alloc.available_size() == 32
    assert_ok(cache)


def test_match_reports_the_host_part_and_load_back_brings_it_back_locked():
    cache, alloc, host, clock = make()
    insert(cache, alloc, list(range(24)))
    cache.check_hicache_events()
    cache.evict(24)
    match = cache.match_prefix(RadixKey(list(range(24)) + [99]))
    assert len(match.device_indices) == 0 and match.last_node is cache.root
    assert match.host_hit_length == 24 and match.last_host_node.value is None
    loaded, last = cache.init_load_back(match.last_host_node, match.host_hit_length)
    assert loaded.tolist() == list(range(25, 33)) + list(range(1, 17))  # the allocator's FIFO order
    assert last is match.last_host_node and last.lock_ref == 1 and cache.protected_size() == 24
    assert cache.ready_to_load_host_cache() == 0.0  # synchronous controller: done at once
    cache.check_hicache_events()
    assert last.lock_ref == 0 and cache.evictable_size() == 24
    assert_ok(cache)


def test_a_short_host_hit_is_not_loaded_back():
    cache, alloc, host, clock = make(threshold=10)
    insert(cache, alloc, list(range(8)))
    cache.check_hicache_events()
    cache.evict(8)
    match = cache.match_prefix(RadixKey(list(range(8)) + [99]))
    assert match.host_hit_length == 8
    loaded, last = cache.init_load_back(match.last_host_node, 8)
    assert len(loaded) == 0 and last is cache.root and cache.ready_to_load_host_cache() is None


def test_load_back_over_the_quota_is_skipped():
    cache, alloc, host, clock = make()
    insert(cache, alloc, list(range(16)))
    cache.check_hicache_events()
    cache.evict(16)
    match = cache.match_prefix(RadixKey(list(range(16))))
    loaded, last = cache.init_load_back(match.last_host_node, 16, mem_quota=15)
    assert len(loaded) == 0 and last is cache.root


def test_write_back_copies_on_eviction_and_waits_for_the_copy():
    cache, alloc, host, clock = make("write_back", bandwidth=1e-3, latency=0.0)  # 32 B per token at 1 MB/s
    insert(cache, alloc, list(range(10)))
    assert cache.host_size() == 0 and cache.root.children[0].hit_count == 0
    assert cache.evict(10) == 10
    node = cache.root.children[0]
    assert node.value is None and node.host_value.tolist() == list(range(10))
    assert cache.written_back_nodes == 1 and not cache.ongoing_write
    assert cache.controller.take_stall_ms() == pytest.approx(10 * 32 / 1e6 * 1e3)
    assert_ok(cache)


def test_host_eviction_frees_host_only_leaves_lowest_priority_first():
    cache, alloc, host, clock = make(size=32, host=36)
    for first in (0, 100, 200):
        insert(cache, alloc, [first + i for i in range(12)])
        cache.check_hicache_events()
        cache.evict(12)
    # Three host copies of 12 do not fit 36 with a fourth: the oldest ([0..11]) goes.
    insert(cache, alloc, [300 + i for i in range(12)])
    assert 0 not in cache.root.children and cache.host_evicted_tokens == 12
    assert host.used_size() == 36
    assert_ok(cache)


def test_writes_hold_their_nodes_for_the_simulated_copy_time():
    cache, alloc, host, clock = make(bandwidth=32e-6, latency=1000.0)  # 1 ms latency, 1 ms per token
    insert(cache, alloc, list(range(12)))
    node = cache.root.children[0]
    clock.now = 12.9
    cache.check_hicache_events()
    assert node.lock_ref == 1 and cache.evict(12) == 0
    clock.now = 13.0
    cache.check_hicache_events()
    assert node.lock_ref == 0 and cache.evict(12) == 12
    stats = cache.controller.stats
    assert stats.d2h_bytes == 12 * 32 and stats.d2h_copies == 1 and stats.d2h_busy_ms == pytest.approx(13.0)


def test_a_device_node_below_an_evicted_node_is_caught():
    cache, alloc, host, clock = make(size=64, host=128)
    insert(cache, alloc, list(range(24)))
    insert(cache, alloc, list(range(12)) + [77] * 12)
    cache.check_hicache_events()
    upper = cache.root.children[0]
    upper.value = None  # planted: the upper node "evicted" while its children keep device slots
    names = {c.name for c in cache.check_integrity().failures}
    assert "host_only_subtrees" in names


def test_a_lost_host_slot_is_caught():
    cache, alloc, host, clock = make()
    insert(cache, alloc, list(range(12)))
    host.alloc(4)  # planted: taken from the host pool by nobody
    assert "host_conservation" in {c.name for c in cache.check_integrity().failures}


def test_an_unlocked_write_in_flight_is_caught():
    cache, alloc, host, clock = make(bandwidth=1e-6)
    insert(cache, alloc, list(range(12)))
    cache.dec_lock_ref(cache.root.children[0])  # planted: the in-flight backup's lock dropped
    assert "copies_in_flight" in {c.name for c in cache.check_integrity().failures}
    with pytest.raises(IntegrityError):
        clock.now = 1e9
        cache.check_hicache_events()  # the ack's unlock finds no lock


def test_host_floor_any_drops_a_node_that_finds_no_room():
    cache, alloc, host, clock = make("write_back", size=32, host=8, floor="any")
    insert(cache, alloc, list(range(12)))
    assert cache.evict(12) == 12
    assert not cache.root.children and cache.host_size() == 0 and alloc.available_size() == 32
    assert_ok(cache)


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_host_pools_smaller_than_the_device_pool_keep_every_invariant(write_policy, seed):
    """semantics.host_pool_floor=any: host pools of half the device pool (SGLang refuses them),
    random operations; backups and write-backs that find no host room drop nodes instead. The
    full walk holds after every operation, and at the end everything is accounted for."""
    from memcli.config import SemanticsConfig
    from memcli.reference.hiops import _apply, _memcli_side, _skip_reason, block_pages, generate_hi_ops

    page_size = 4
    size = 12 * block_pages(page_size) * page_size
    side = _memcli_side(size, page_size, "lru", write_policy, 0.5, SemanticsConfig(profile="memcli"))
    side.locks = locks = {}
    for index, op in enumerate(generate_hi_ops(seed, page_size, 200)):
        if _skip_reason(op, side, locks) is None:
            _apply(side, index, op)
            if op.kind in ("lock", "unlock"):
                locks[op.arg] = locks.get(op.arg, 0) + (1 if op.kind == "lock" else -1)
        assert_ok(side.tree)
    tree = side.tree
    assert tree.host_size() + tree.host_pool.available_size() == tree.host_pool.size
    assert side.allocator.available_size() + tree.total_size() == side.allocator.size


def test_a_host_slot_held_twice_or_out_of_range_is_caught():
    """The counts still add up, but a node's host slot is also on the free list (or is no slot
    at all): the deep check marks every slot once and finds it."""
    cache, alloc, host, clock = make()
    insert(cache, alloc, list(range(12)))
    cache.check_hicache_events()
    node = cache.root.children[0]
    assert node.host_value is not None
    assert_ok(cache)
    free_slot = int(host.free_slot_ids()[0])
    kept = node.host_value.clone()
    node.host_value[0] = free_slot
    failures = [c for c in cache.check_integrity().failures if c.name == "host_conservation"]
    assert failures and "held twice" in failures[0].detail
    node.host_value = kept.clone()
    node.host_value[0] = host.size
    failures = [c for c in cache.check_integrity().failures if c.name == "host_conservation"]
    assert failures and "outside" in failures[0].detail
    node.host_value = kept
    assert_ok(cache)
