"""ChunkCache: nothing shared, a request's slots carried between chunks and freed on finish."""

import numpy as np
import pytest
import torch

from memcli.errors import IntegrityError
from memcli.mem_cache.base_prefix_cache import RadixKey
from memcli.mem_cache.chunk_cache import ChunkCache
from tests.mem_cache.fakes import FakeReq, Harness


@pytest.mark.parametrize("ps", [1, 4])
def test_chunks_then_finish_free_everything(ps):
    h = Harness(ChunkCache, page_size=ps)
    cache = h.cache
    assert cache.disable and cache.page_size == ps
    req = FakeReq(np.arange(100, 111))
    h.admit(req)
    assert len(req.prefix_indices) == 0 and req.last_node is None
    for upto in (3, 7, 11):
        h.prefill(req, upto)
        row = h.pool.req_to_token[req.req_pool_idx, :upto]
        assert req.prefix_indices.dtype == torch.int64
        assert req.prefix_indices.device == cache.device
        assert req.prefix_indices.tolist() == row.tolist()
        assert cache.protected_size() == 0  # what requests hold is counted per request, once
    h.decode(req, 1)
    h.decode(req, 2)
    assert req.kv_allocated_len == 12
    h.finish(req)
    assert cache.protected_size() == 0
    assert h.allocator.available_size() == h.allocator.size  # partial last page freed too
    assert len(h.pool.free_rows) == 8
    assert cache.check_integrity().ok


def test_prefix_indices_are_a_copy():
    h = Harness(ChunkCache, page_size=1)
    req = FakeReq(np.arange(5))
    h.admit(req)
    h.prefill(req, 5)
    h.pool.req_to_token[req.req_pool_idx, 0] = 999
    assert req.prefix_indices[0].item() != 999


def test_nothing_is_shared_or_evicted():
    h = Harness(ChunkCache, page_size=1)
    cache = h.cache
    assert cache.match_prefix(RadixKey([1, 2, 3])).device_indices.tolist() == []
    assert cache.insert(RadixKey([1, 2, 3]), torch.tensor([4, 5, 6])) == 0
    assert cache.evict(100) == 0
    assert cache.inc_lock_ref(None) == 0 and cache.dec_lock_ref(None) == 0
    assert (cache.evictable_size(), cache.total_size()) == (0, 0)
    assert cache.take_events() == []
    cache.reset()


def test_finishing_twice_raises():
    h = Harness(ChunkCache, page_size=1)
    req = FakeReq(np.arange(4))
    h.admit(req)
    h.prefill(req, 4)
    h.finish(req)
    with pytest.raises(IntegrityError, match="already freed"):
        h.cache.cache_finished_req(req)


def test_integrity_check_catches_a_page_size_the_allocator_does_not_have():
    from memcli.mem_cache.chunk_cache import ChunkCache
    from tests.mem_cache.fakes import FakeAllocator

    allocator = FakeAllocator(64, page_size=4)
    assert ChunkCache(None, allocator, page_size=4).check_integrity().ok
    report = ChunkCache(None, allocator, page_size=1).check_integrity()
    assert not report.ok and "cache 1, allocator 4" in report.failures[0].detail
