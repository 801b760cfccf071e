"""ReqToTokenPool rows (FIFO reuse, exhaustion, double free) and KVPool buffer shapes."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from memcli.errors import RequestSlotsExhausted
from types import SimpleNamespace

from memcli.mem_cache.manager import MemoryManager
from memcli.mem_cache import pools
from memcli.mem_cache.pools import KVPool, ReqToTokenPool

CPU = torch.device("cpu")


def rows_pool(size=4, cols=8):
    return ReqToTokenPool(size, cols, CPU)


def failed(pool):
    return {c.name for c in pool.check_integrity().failures}


# ------------------------------------------------------------------ ReqToTokenPool


def test_table_shape_and_initial_state():
    pool = rows_pool(3, 12)
    assert pool.req_to_token.shape == (3, 12)
    assert pool.req_to_token.dtype == torch.int32
    assert not pool.req_to_token.any()
    assert pool.free_slots == [0, 1, 2]
    assert pool.available_size() == 3
    assert pool.rows_in_use() == []
    assert pool.check_integrity().ok


def test_a_large_table_on_a_cpu_reads_zero_and_takes_writes():
    """The CPU table comes from zeroed pages the OS hands out on first touch (nothing is
    written at set-up): every entry reads 0, and a write lands in its row only."""
    pool = ReqToTokenPool(64, 131072, torch.device("cpu"))
    table = pool.req_to_token
    assert table.shape == (64, 131072) and table.dtype == torch.int32 and table.is_contiguous()
    assert int(table[63, 131071]) == 0 and not table[::7, ::4096].any()
    table[5, 10:20] = torch.arange(10, dtype=torch.int32)
    assert table[5, 10:20].tolist() == list(range(10)) and int(table.sum()) == 45


def _vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping of this process that holds `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's header: start-end perms ...
            lo, hi = (int(part, 16) for part in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hasattr(mmap, "MADV_NOHUGEPAGE") or not Path("/proc/self/smaps").exists(),
                    reason="huge-page advice and /proc/self/smaps are Linux's")
def test_the_cpu_table_is_a_private_mapping_advised_off_huge_pages():
    """A first write into a 2 MiB huge page zeroes all of it; the table, written row by row up
    to each request's length, takes 4 KiB pages. Private: a forked study worker gets its own."""
    table = ReqToTokenPool(16, 131072, CPU).req_to_token
    flags = _vm_flags(table.data_ptr())
    assert "nh" in flags and "sh" not in flags, flags
    table[15, 131071] = 7
    assert int(table.sum()) == 7


def test_an_empty_table_is_an_empty_array():
    assert pools._zeroed_host(0, 8).shape == (0, 8)
    assert pools._zeroed_host(3, 0).shape == (3, 0)


def test_rows_are_reused_fifo():
    pool = rows_pool(4)
    assert pool.alloc(2) == [0, 1]
    pool.free(0)
    assert pool.free_slots == [2, 3, 0]
    assert pool.alloc(2) == [2, 3]
    pool.free([3, 1])
    assert pool.free_slots == [0, 3, 1]
    assert pool.alloc(3) == [0, 3, 1]
    assert pool.rows_in_use() == [0, 1, 2, 3]
    assert pool.check_integrity().ok


def test_alloc_does_not_clear_rows():
    pool = rows_pool(2)
    (row,) = pool.alloc(1)
    pool.req_to_token[row, :3] = torch.tensor([7, 8, 9], dtype=torch.int32)
    pool.free(row)
    pool.alloc(1)
    assert pool.alloc(1) == [row]
    assert pool.req_to_token[row, :3].tolist() == [7, 8, 9]


def test_exhaustion_returns_none_and_changes_nothing():
    pool = rows_pool(3)
    pool.alloc(2)
    assert pool.alloc(2) is None
    assert pool.free_slots == [2]
    assert pool.alloc(0) == []
    assert pool.alloc(1) == [2]
    assert pool.alloc(1) is None


def test_alloc_req_slots_message_carries_the_numbers():
    pool = rows_pool(3)
    pool.alloc(2)
    memory = MemoryManager(SimpleNamespace(req_to_token_pool=pool, allocator=None, tree_cache=None))
    with pytest.raises(RequestSlotsExhausted) as info:
        memory.alloc_rows(2)
    message = str(info.value)
    assert "need 2 rows, 1 of 3 free" in message
    assert "memory.max_running_requests" in message
    assert memory.alloc_rows(1) == [2]


@pytest.mark.parametrize("bad", [1, [1], [0, 1], [2, 2], [5], [-1]])
def test_double_or_foreign_free_raises_and_changes_nothing(bad):
    pool = rows_pool(4)
    pool.alloc(3)
    pool.free(1)
    before = (list(pool.free_slots), pool.rows_in_use())
    with pytest.raises(ValueError, match="freed twice or never allocated"):
        pool.free(bad)
    assert (pool.free_slots, pool.rows_in_use()) == before
    assert pool.check_integrity().ok


def test_free_of_a_duplicate_in_one_call_is_refused():
    pool = rows_pool(4)
    pool.alloc(4)
    with pytest.raises(ValueError, match="request row 2"):
        pool.free([2, 2])
    assert pool.free_slots == []
    assert pool.rows_in_use() == [0, 1, 2, 3]
    assert pool.check_integrity().ok


def test_clear_frees_every_row():
    pool = rows_pool(3)
    pool.alloc(3)
    pool.clear()
    assert pool.free_slots == [0, 1, 2]
    assert pool.rows_in_use() == []
    assert pool.alloc(3) == [0, 1, 2]


def test_integrity_reports_planted_faults():
    pool = rows_pool(4)
    pool.alloc(2)
    report = pool.check_integrity()
    assert report.ok
    assert report.check("free + in use == size").detail == "free 2 + in use 2 vs size 4"
    pool.free_slots.append(2)  # a row listed twice
    assert failed(pool) == {"no duplicate free rows", "free + in use == size"}
    pool.free_slots.pop()
    pool.free_slots.pop()  # a row lost
    assert failed(pool) == {"free + in use == size"}


# ------------------------------------------------------------------ KVPool


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_kv_buffers_have_size_plus_page_size_rows(page_size):
    pool = KVPool(64, page_size, num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", device=CPU)
    shape = (3, 64 + page_size, 2, 8)
    assert pool.rows == 64 + page_size
    assert tuple(pool.k_buffer.shape) == shape and tuple(pool.v_buffer.shape) == shape
    assert pool.k_buffer.dtype == torch.bfloat16
    assert pool.k_buffer.data_ptr() != pool.v_buffer.data_ptr()
    assert not pool.k_buffer.any() and not pool.v_buffer.any()


@pytest.mark.parametrize(
    "dtype, itemsize",
    [("float32", 4), ("bfloat16", 2), ("float16", 2), ("float8_e4m3fn", 1), ("float8_e5m2", 1)],
)
def test_bytes_per_token(dtype, itemsize):
    pool = KVPool(16, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, device=CPU)
    assert pool.bytes_per_token == 3 * 2 * 8 * 2 * itemsize
    assert pool.rows * pool.bytes_per_token == (16 + 4) * pool.bytes_per_token
    assert pool.k_buffer.element_size() == itemsize
    assert pool.k_buffer.numel() * itemsize * 2 == pool.rows * pool.bytes_per_token


def test_indices_only_mode_allocates_nothing():
    pool = KVPool(1 << 20, 64, num_layers=80, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                  device=CPU, materialized=False)
    assert pool.k_buffer is None and pool.v_buffer is None
    assert not pool.materialized
    assert pool.rows == (1 << 20) + 64
    assert pool.bytes_per_token == 80 * 8 * 128 * 2 * 2
    assert pool.rows * pool.bytes_per_token == ((1 << 20) + 64) * 327680


def test_unknown_dtype_is_rejected():
    with pytest.raises(KeyError):
        KVPool(16, 4, 1, 1, 8, dtype="int8", device=CPU)


def test_free_range_is_the_free_of_those_rows():
    pools = [rows_pool(6), rows_pool(6)]
    for pool in pools:
        pool.alloc(6)
        pool.free([4])
    pools[0].free_range(1, 3)
    pools[1].free([1, 2, 3])
    assert pools[0].free_slots == pools[1].free_slots == [4, 1, 2, 3]
    assert pools[0].rows_in_use() == pools[1].rows_in_use() == [0, 5]


@pytest.mark.parametrize("first, n", [(3, 3), (5, 2), (-1, 2)])  # row 4 free; past the end; before 0
def test_free_range_refuses_a_row_not_in_use_and_frees_none(first, n):
    pool = rows_pool(6)
    pool.alloc(6)
    pool.free([4])
    with pytest.raises(ValueError, match="freed twice or never allocated"):
        pool.free_range(first, n)
    assert pool.free_slots == [4]
    assert pool.rows_in_use() == [0, 1, 2, 3, 5]


def test_free_range_tells_the_row_observer():
    pool = rows_pool(4)
    released = []
    pool.ledger = SimpleNamespace(rows_released=lambda rows: released.append(list(rows)))
    pool.alloc(4)
    pool.free_range(1, 2)
    assert released == [[1, 2]]
    assert pool.free_slots == [1, 2]


def test_free_range_under_the_reserved_row_0():
    """lifo_row0 (0.5.23): rows 1..size are handed out from the tail and row 0 never is; a range
    free covers the last row and refuses row 0, as `free` does."""
    pool = ReqToTokenPool(4, 8, CPU, row_order="lifo_row0")
    assert pool.alloc(4) == [1, 2, 3, 4]
    pool.free_range(3, 2)
    assert pool.free_slots == [3, 4] and pool.rows_in_use() == [1, 2]
    with pytest.raises(ValueError, match="freed twice or never allocated"):
        pool.free_range(0, 2)
    assert pool.rows_in_use() == [1, 2]
