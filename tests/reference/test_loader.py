"""SGLang's real classes, loaded from the wheel, on CPU (allocator kernels in the Triton
interpreter); exact slot ids, match lengths and eviction sizes."""

import os

import pytest
import torch

from memcli.mem_cache.clock import LogicalClock
from memcli.reference import STANDINS


@pytest.fixture
def clocked(ref):
    clock = LogicalClock()
    ref.use_clock(clock)
    yield clock
    ref.restore_clock()


def _tree(ref, page_size, size=64, policy="lru"):
    kv_pool = ref.tiny_kv_pool(size, page_size)
    if page_size == 1:
        allocator = ref.TokenToKVPoolAllocator(size, torch.int64, ref.device, kv_pool, False)
    else:
        allocator = ref.PagedTokenToKVPoolAllocator(size, page_size, torch.int64, ref.device, kv_pool, False)
    return ref.RadixCache(None, allocator, page_size, eviction_policy=policy), allocator


def test_modules_are_sglangs_own(ref):
    assert ref.radix_cache.__file__.startswith(str(ref.root))
    assert ref.RadixCache.__module__ == "sglang.srt.mem_cache.radix_cache"
    for name in ("RadixKey", "TreeNode", "ChunkCache", "ReqToTokenPool", "MHATokenToKVPool",
                 "TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator", "Req", "ScheduleBatch"):
        assert isinstance(getattr(ref, name), type), name
    for name in ("alloc_for_extend", "alloc_for_decode", "evict_from_tree_cache", "write_cache_indices"):
        assert callable(getattr(ref.common, name)), name
    for name in ("PrefillAdder", "SchedulePolicy", "AddReqResult"):
        assert hasattr(ref.schedule_policy, name), name


def test_only_documented_standins_are_used(ref):
    assert set(ref.standins) <= set(STANDINS)
    assert all(reason for reason in ref.standins.values())
    assert "sglang.srt.mem_cache.radix_cache" not in ref.standins


def test_kernels_run_in_the_interpreter_without_cuda(ref):
    if not torch.cuda.is_available():
        assert ref.interpreted and os.environ["TRITON_INTERPRET"] == "1"


def test_logical_clock_stamps_tree_nodes(ref, clocked):
    node = ref.TreeNode()
    assert (node.last_access_time, node.creation_time) == (1.0, 2.0)
    assert clocked.now == 2.0


def test_radix_cache_page_size_1(ref, clocked):
    tree, allocator = _tree(ref, 1)
    slots = allocator.alloc(6)
    assert slots.tolist() == [1, 2, 3, 4, 5, 6]
    assert tree.insert(ref.RadixKey([1, 2, 3, 4]), slots[:4].clone()) == 0
    assert tree.insert(ref.RadixKey([1, 2, 9, 9]), torch.tensor([5, 6, 7, 8], device=ref.device)) == 2
    allocator.free(torch.tensor([5, 6], device=ref.device))  # the duplicate prefix
    match = tree.match_prefix(ref.RadixKey([1, 2, 3, 7]))
    assert match.device_indices.tolist() == [1, 2, 3]  # split [3, 4] into [3] + [4]
    assert (tree.evictable_size(), tree.total_size()) == (6, 6)
    assert tree.inc_lock_ref(match.last_device_node) == -3
    tree.evict(4)  # locked path [1, 2, 3] stays; leaves [9, 9] and [4] go, oldest first
    assert (tree.evictable_size(), tree.protected_size()) == (0, 3)
    assert allocator.free_pages[-3:].tolist() == [7, 8, 4]


def test_radix_cache_page_size_16(ref, clocked):
    ps = 16
    tree, allocator = _tree(ref, ps, size=8 * ps)
    a = allocator.alloc(3 * ps)
    assert a.tolist() == list(range(16, 64))
    key = [1] * 16 + [2] * 16 + [3] * 16
    assert tree.insert(ref.RadixKey(key), a.clone()) == 0
    assert len(tree.match_prefix(ref.RadixKey(key[:40])).device_indices) == 32  # floored to pages
    assert len(tree.match_prefix(ref.RadixKey([1] * 15)).device_indices) == 0  # under one page
    b = allocator.alloc(ps)
    assert tree.insert(ref.RadixKey([5] * 16), b.clone()) == 0
    tree.evict(1)  # node granular: the least recent leaf, [3] * 16, a whole page
    assert tree.evictable_size() == 3 * ps
    assert allocator.free_pages[:2].tolist() == [3, 5]
    tree.evict(ps + 1)  # then the split-off [1..2] * 16 (older than [5] * 16): 32 tokens
    assert (tree.evictable_size(), tree.total_size()) == (ps, ps)
    assert allocator.free_pages[:4].tolist() == [1, 2, 3, 5]


def test_paged_allocator_kernels(ref):
    """SGLang's alloc_extend / alloc_decode kernels: interpreted on a CPU, compiled on a GPU."""
    ps = 4
    dev = ref.device
    allocator = ref.PagedTokenToKVPoolAllocator(16 * ps, ps, torch.int64, ref.device, ref.tiny_kv_pool(16 * ps, ps), False)
    first = allocator.alloc(ps)  # page 1: slots 4..7, so a prefix of 2 tokens ends at slot 5
    assert first.tolist() == [4, 5, 6, 7]
    prefix_lens_cpu, seq_lens_cpu = torch.tensor([0, 2]), torch.tensor([5, 11])
    prefix_lens, seq_lens = prefix_lens_cpu.to(dev), seq_lens_cpu.to(dev)
    last_loc = torch.tensor([-1, 5], device=dev)
    out = allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, 14)
    # request 0: new pages 2, 3 (5 tokens); request 1: rest of page 1, then pages 4 and 5
    assert out.tolist() == [8, 9, 10, 11, 12, 6, 7, 16, 17, 18, 19, 20, 21, 22]
    assert allocator.free_pages[0].item() == 6
    decode_seq_lens = torch.tensor([6, 13])  # request 0 stays in page 3; request 1 opens page 6
    out = allocator.alloc_decode(decode_seq_lens.to(dev), decode_seq_lens, torch.tensor([12, 23], device=dev))
    assert out.tolist() == [13, 24]
    assert allocator.free_pages[0].item() == 7


def test_req_to_token_pool_chunk_cache_and_write_cache_indices(ref):
    pool = ref.ReqToTokenPool(4, 16, ref.device, enable_memory_saver=False)
    allocator = ref.TokenToKVPoolAllocator(32, torch.int64, ref.device, ref.tiny_kv_pool(32, 1), False)
    cache = ref.ChunkCache(pool, allocator, page_size=1)
    assert pool.alloc(2) == [0, 1] and cache.evictable_size() == 0
    out = allocator.alloc(5)  # [1..5]: request 0 extends 2 -> 5 over prefix [9, 8]; request 1 has 0 -> 2
    t = torch.tensor
    ref.common.write_cache_indices(out, t([0, 1]), t([0, 1]), t([2, 0]), t([2, 0]), t([5, 2]), t([5, 2]),
                                   t([3, 2]), t([3, 2]), [t([9, 8]), t([], dtype=torch.int64)], pool)
    assert pool.req_to_token[0, :5].tolist() == [9, 8, 1, 2, 3]
    assert pool.req_to_token[1, :2].tolist() == [4, 5]
