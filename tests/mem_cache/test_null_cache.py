"""NullCache: the benchmarks' cache takes the config's page size and never evicts."""

import numpy as np
import pytest
import torch

from memcli.errors import IntegrityError
from memcli.mem_cache.base_prefix_cache import RadixKey
from memcli.mem_cache.null_cache import NullCache
from tests.mem_cache.fakes import FakeReq, Harness


@pytest.mark.parametrize("ps", [1, 16])
def test_page_size_is_the_one_given(ps):
    h = Harness(NullCache, page_size=ps)
    assert h.cache.page_size == ps == h.allocator.page_size


def test_no_op_cache_interface():
    cache = Harness(NullCache, page_size=4).cache
    assert cache.disable
    result = cache.match_prefix(RadixKey([1, 2, 3, 4, 5]))
    assert result.device_indices.dtype == torch.int64 and len(result.device_indices) == 0
    assert cache.insert(RadixKey([1, 2, 3, 4])) == 0
    assert cache.evict(1 << 20) == 0
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    assert cache.inc_lock_ref(result.last_node) == 0 and cache.dec_lock_ref(result.last_node) == 0
    assert cache.check_integrity().ok
    cache.reset()


@pytest.mark.parametrize("ps", [1, 4])
def test_finish_frees_the_request_slots_and_row(ps):
    h = Harness(NullCache, page_size=ps)
    req = FakeReq(np.arange(10))
    h.admit(req)
    h.extend(req, 10)
    h.decode(req, 7)
    h.finish(req)
    assert req.kv_freed
    assert h.allocator.available_size() == h.allocator.size
    assert len(h.pool.free_rows) == 8
    with pytest.raises(IntegrityError, match="already freed"):
        h.cache.cache_finished_req(req)


def test_unfinished_records_int64_prefix():
    h = Harness(NullCache, page_size=1)
    req = FakeReq(np.arange(6))
    h.admit(req)
    h.prefill(req, 6)
    assert req.prefix_indices.dtype == torch.int64
    assert req.prefix_indices.tolist() == h.pool.req_to_token[req.req_pool_idx, :6].tolist()
