"""HostKVPool: SGLang's free-list order (head out, tail in), page rules, copies."""

import pytest
import torch

from memcli.mem_cache.host_pool import HostKVPool
from memcli.mem_cache.pools import KVPool


def test_alloc_takes_the_head_and_free_appends_at_the_tail():
    pool = HostKVPool(8, 2, 1, 1, 1, "float32")
    a = pool.alloc(4)
    b = pool.alloc(2)
    assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [4, 5]
    pool.free(a[:2])
    assert pool.free_slot_ids().tolist() == [6, 7, 0, 1]
    assert pool.alloc(4).tolist() == [6, 7, 0, 1]  # wraps around the ring
    assert pool.alloc(2) is None and pool.available_size() == 0
    assert pool.check_integrity().ok


def test_page_rules_and_double_free():
    pool = HostKVPool(8, 4, 1, 1, 1, "float32")
    with pytest.raises(ValueError, match="multiple of page_size"):
        pool.alloc(2)
    with pytest.raises(ValueError, match="double free"):
        pool.free(torch.arange(4))
    with pytest.raises(ValueError, match="multiple of page_size"):
        HostKVPool(6, 4, 1, 1, 1, "float32")


@pytest.mark.parametrize("paired_runs", [64, 0])  # slices of runs, or one gather / scatter
def test_backup_and_load_copy_every_layer(monkeypatch, paired_runs):
    import memcli.mem_cache.host_pool as host_pool

    monkeypatch.setattr(host_pool, "MAX_PAIRED_RUNS", paired_runs)
    device = KVPool(16, 1, 2, 2, 4, "float32", torch.device("cpu"))
    device.k_buffer.normal_()
    device.v_buffer.normal_()
    host = HostKVPool(32, 1, 2, 2, 4, "float32", materialized=True)
    host.alloc(30)
    host.free(torch.tensor([7, 8, 29, 3]))  # the next slots are not one run: 30, 31, 7, 8, 29, 3
    src = torch.tensor([3, 5, 9, 10, 11, 12])
    slots = host.alloc(6)
    assert slots.tolist() == [30, 31, 7, 8, 29, 3]
    host.backup_from_device(device, src, slots)
    assert torch.equal(host.k_buffer[slots], device.k_buffer[:, src].transpose(0, 1))
    dst = torch.tensor([1, 2, 4, 6, 7, 8])
    host.load_to_device(device, slots, dst)
    assert torch.equal(device.v_buffer[:, dst], device.v_buffer[:, src])
    assert torch.equal(device.k_buffer[:, dst], device.k_buffer[:, src])
    assert host.bytes_per_token == device.bytes_per_token == 2 * 2 * 4 * 2 * 4
