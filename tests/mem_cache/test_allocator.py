"""Token and paged allocators: exact slot ids and exact free lists, worked examples of the
reference (sections 3.2, 3.3 and 10.7), integrity checks and planted faults."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import memcli.kernels
from memcli.errors import IntegrityError
from memcli.mem_cache.allocator import (
    AllocatorState,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    make_allocator,
)
from memcli.mem_cache.pages import extend_new_pages

CPU = torch.device("cpu")
# These allocators live on the CPU: there the triton backend runs interpreted, which
# tests/conftest.py turns on only on a host without CUDA (the GPU runs tests/kernels instead).
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need the Triton interpreter"))]

ALL_CHECKS = {
    "free list within range",
    "no duplicate in free list",
    "slot 0 never free",
    "available + in use == size",
}


def i64(values):
    return torch.tensor(values, dtype=torch.int64)


def token(size, **kwargs):
    return TokenToKVPoolAllocator(size, CPU, **kwargs)


def paged(size, page_size=4, **kwargs):
    return PagedTokenToKVPoolAllocator(size, page_size, CPU, **kwargs)


def free_list(allocator):
    return allocator.free_page_ids().tolist()


def page_slots(pages, page_size=4):
    """Every slot of `pages`, page-major (what freeing a whole request gives)."""
    return i64([p * page_size + k for p in pages for k in range(page_size)])


def extend(allocator, prefix_lens, seq_lens, last_loc):
    """An extend batch through `alloc_extend_write` (the path of `common.alloc_for_extend`) on
    scratch rows, request i in row i: each prefix is `prefix_lens[i]` slots ending at
    `last_loc[i]`. The new slots, or None."""
    pre, seq = i64(prefix_lens), i64(seq_lens)
    prefixes = [i64([0] * (p - 1) + [last]) if p else i64([]) for p, last in zip(prefix_lens, last_loc)]
    rows = torch.zeros((len(seq_lens), max(seq_lens, default=0) + 1), dtype=torch.int32)
    num_pages = extend_new_pages(pre, seq, allocator.page_size)
    got = allocator.alloc_extend_write(rows, list(range(len(seq_lens))), pre, seq, prefixes, num_pages)
    return None if got is None else got.out_cache_loc


def decode(allocator, seq_lens, last_loc):
    """A decode step through `alloc_decode_write` on scratch rows: `seq_lens` count the new
    token, `last_loc[i]` is the slot before it. The new slots, or None."""
    before = i64(seq_lens) - 1
    rows = torch.zeros((len(seq_lens), max(seq_lens, default=0) + 1), dtype=torch.int32)
    for i, (n, last) in enumerate(zip(seq_lens, last_loc)):
        if n >= 2:
            rows[i, n - 2] = last
    got = allocator.alloc_decode_write(before, before.clone(), i64(list(range(len(seq_lens)))), rows)
    return None if got is None else got.out_cache_loc


def failed_checks(allocator):
    report = allocator.check_integrity()
    assert {c.name for c in report.checks} == ALL_CHECKS
    return {c.name for c in report.failures}


def forbid_kernel(monkeypatch, name):
    """Make `memcli.kernels.<name>` (what the allocator calls) raise if it is launched."""

    def launched(*args, **kwargs):
        raise AssertionError(f"kernel {name} launched although the capacity check failed")

    monkeypatch.setattr(memcli.kernels, name, launched)


# ------------------------------------------------------------------ token allocator (ps 1)


def test_token_worked_example():
    allocator = token(8)
    assert free_list(allocator) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert allocator.alloc(3).tolist() == [1, 2, 3]
    assert free_list(allocator) == [4, 5, 6, 7, 8]
    allocator.free(i64([2]))
    assert free_list(allocator) == [4, 5, 6, 7, 8, 2]
    assert allocator.alloc(6).tolist() == [4, 5, 6, 7, 8, 2]
    assert free_list(allocator) == []
    assert allocator.available_size() == 0
    assert allocator.in_use_tokens == 8
    assert allocator.alloc(1) is None
    assert allocator.check_integrity().ok


def test_token_fifo_across_ring_wrap():
    allocator = token(4)
    assert allocator.alloc(3).tolist() == [1, 2, 3]
    allocator.free(i64([2]))  # lands at the buffer's start: the ring wraps
    allocator.free(i64([3, 1]))
    assert free_list(allocator) == [4, 2, 3, 1]
    assert allocator.alloc(2).tolist() == [4, 2]
    allocator.free(i64([4]))
    assert free_list(allocator) == [3, 1, 4]
    assert allocator.alloc(3).tolist() == [3, 1, 4]
    assert allocator.check_integrity().ok


def test_token_alloc_returns_a_copy_not_the_ring():
    allocator = token(4)
    out = allocator.alloc(2)
    allocator.free(out.clone())
    assert out.tolist() == [1, 2]
    assert allocator.alloc(4).tolist() == [3, 4, 1, 2]
    assert out.tolist() == [1, 2]


def test_token_alloc_extend_and_decode_take_from_the_head():
    allocator = token(8)
    assert extend(allocator, [0, 2], [3, 4], [-1, 17]).tolist() == [1, 2, 3, 4, 5]
    assert decode(allocator, [4, 5], [3, 5]).tolist() == [6, 7]
    assert extend(allocator, [0], [2], [-1]) is None
    assert free_list(allocator) == [8]


def test_token_available_size_counts_release_list():
    allocator = token(8, need_sort=True)
    slots = allocator.alloc(5)
    allocator.free(slots[:2])
    assert free_list(allocator) == [6, 7, 8, 1, 2]
    assert allocator.available_size() == 5
    # Three fit in the free list, so no merge happens yet.
    assert allocator.alloc(3).tolist() == [6, 7, 8]
    allocator.free(i64([5, 3]))
    # Not enough in the free list: merge the release list, sorted.
    assert allocator.alloc(3).tolist() == [1, 2, 3]
    assert free_list(allocator) == [5]
    assert allocator.check_integrity().ok


def test_release_list_does_not_alias_the_callers_tensor():
    allocator = token(8, need_sort=True)
    slots = allocator.alloc(3)
    freed = slots[:2]
    allocator.free(freed)
    freed.fill_(0)
    assert free_list(allocator) == [4, 5, 6, 7, 8, 1, 2]
    assert allocator.check_integrity().ok


# ------------------------------------------------------------------ paged allocator


def test_paged_alloc_whole_pages():
    allocator = paged(16)
    assert allocator.alloc(8).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert free_list(allocator) == [3, 4]
    assert allocator.available_size() == 8
    with pytest.raises(ValueError, match="multiple of page_size"):
        allocator.alloc(6)
    assert allocator.alloc(12) is None
    assert free_list(allocator) == [3, 4]


def test_paged_free_prepends_sorted_unique_pages():
    """Reference 3.3: free list [5, 6, ...], free([8, 9, 41]) with ps 4 -> [2, 10, 5, 6, ...]."""
    allocator = paged(48)
    allocator.alloc(48)
    allocator.free(page_slots([5, 6, 7, 8, 9, 11, 12]))
    assert free_list(allocator) == [5, 6, 7, 8, 9, 11, 12]
    allocator.free(i64([41, 8, 9]))
    assert free_list(allocator) == [2, 10, 5, 6, 7, 8, 9, 11, 12]
    assert allocator.available_size() == 9 * 4
    assert allocator.check_integrity().ok


def spec_extend_state(backend="torch"):
    """Free list [1, 2, 3, 4, 5, ...]; R1's prefix on pages 20 and 10 (last slot 40), R2's on
    pages 21 and 11 (last slot 47)."""
    allocator = paged(24 * 4, backend=backend)
    allocator.alloc(24 * 4)
    allocator.free(page_slots([p for p in range(1, 25) if p not in (10, 11, 20, 21)]))
    assert free_list(allocator)[:6] == [1, 2, 3, 4, 5, 6]
    return allocator


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_alloc_extend_worked_example(backend):
    """Reference 3.3.2, slot for slot."""
    allocator = spec_extend_state(backend)
    out = extend(allocator, [0, 5, 8], [6, 11, 9], [-1, 40, 47])
    assert out.tolist() == [4, 5, 6, 7, 8, 9, 41, 42, 43, 12, 13, 14, 16]
    assert free_list(allocator) == [5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17, 18, 19, 22, 23, 24]
    assert allocator.in_use_tokens == (4 + 4) * 4
    assert allocator.check_integrity().ok


def decode_state(backend="torch"):
    """Three requests of lengths 6, 8, 11 on pages [1, 2], [3, 4], [5, 6, 7]; page 8 free."""
    allocator = paged(32, backend=backend)
    out = extend(allocator, [0, 0, 0], [6, 8, 11], [-1, -1, -1])
    assert out.tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17, 18, 19,
                            20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
    assert free_list(allocator) == [8]
    return allocator


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_alloc_decode_example(backend):
    """Reference 3.3.3: next lengths [7, 9, 12]; only the second request opens a page."""
    allocator = decode_state(backend)
    assert decode(allocator, [7, 9, 12], [9, 19, 30]).tolist() == [10, 32, 31]
    assert free_list(allocator) == []
    assert allocator.check_integrity().ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_alloc_decode_write(backend):
    """Lengths before the token; column seq_len is written; new page iff seq_len % ps == 0."""
    allocator = decode_state(backend)
    req_to_token = torch.zeros((4, 16), dtype=torch.int32)
    rows = {0: [4, 5, 6, 7, 8, 9], 2: [12, 13, 14, 15, 16, 17, 18, 19],
            3: list(range(20, 31))}
    for row, slots in rows.items():
        req_to_token[row, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    before = req_to_token.clone()
    seq = i64([6, 8, 11])
    out, after = allocator.alloc_decode_write(seq, seq.clone(), i64([0, 2, 3]), req_to_token)
    assert after.tolist() == [7, 9, 12] and seq.tolist() == [6, 8, 11]  # eager path: new lengths, old ones kept
    assert out.tolist() == [10, 32, 31]
    assert req_to_token[0, 6] == 10 and req_to_token[2, 8] == 32 and req_to_token[3, 11] == 31
    changed = (req_to_token != before).nonzero().tolist()
    assert changed == [[0, 6], [2, 8], [3, 11]]
    assert free_list(allocator) == []
    # Lengths 7 and 9 stay on their pages; length 12 would open one and none is left.
    seq = i64([7, 9])
    assert allocator.alloc_decode_write(seq, seq.clone(), i64([0, 2]), req_to_token).out_cache_loc.tolist() == [11, 33]
    assert req_to_token[0, 7] == 11 and req_to_token[2, 9] == 33
    assert allocator.alloc_decode_write(i64([12]), i64([12]), i64([3]), req_to_token) is None
    assert req_to_token[3, 12] == 0
    assert allocator.check_integrity().ok


def test_paged_alloc_decode_write_out_of_pages_changes_nothing(monkeypatch):
    allocator = decode_state()
    allocator.alloc(4)
    forbid_kernel(monkeypatch, "alloc_decode_write")
    req_to_token = torch.zeros((2, 16), dtype=torch.int32)
    seq = i64([8])
    assert allocator.alloc_decode_write(seq, seq.clone(), i64([1]), req_to_token) is None
    assert not req_to_token.any()
    assert free_list(allocator) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_alloc_decode_write(backend):
    allocator = token(6, backend=backend)
    allocator.alloc(4)
    allocator.free(i64([2]))
    assert free_list(allocator) == [5, 6, 2]
    req_to_token = torch.zeros((3, 8), dtype=torch.int32)
    seq = i64([3, 0, 5])
    out = allocator.alloc_decode_write(seq, seq.clone(), i64([2, 0, 1]), req_to_token).out_cache_loc
    assert out.tolist() == [5, 6, 2]
    assert req_to_token[2, 3] == 5 and req_to_token[0, 0] == 6 and req_to_token[1, 5] == 2
    assert int(req_to_token.count_nonzero()) == 3
    assert allocator.alloc_decode_write(i64([1]), i64([1]), i64([0]), req_to_token) is None
    assert allocator.check_integrity().ok


# ------------------------------------------------------------------ OOM gate (reference 10.7)


def test_oom_extend_returns_none_without_launching_the_kernel(monkeypatch):
    allocator = paged(8)
    assert free_list(allocator) == [1, 2]
    with monkeypatch.context() as patch:
        forbid_kernel(patch, "alloc_extend_write")
        assert extend(allocator, [0], [12], [-1]) is None
    assert free_list(allocator) == [1, 2]
    assert allocator.in_use_tokens == 0
    out = extend(allocator, [0], [8], [-1])
    assert out.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert free_list(allocator) == []
    assert allocator.check_integrity().ok


def test_oom_decode_returns_none_without_launching_the_kernel(monkeypatch):
    allocator = paged(8)
    with monkeypatch.context() as patch:
        forbid_kernel(patch, "alloc_decode_write")
        assert decode(allocator, [5, 9, 13], [3, 7, 11]) is None
    assert free_list(allocator) == [1, 2]
    assert decode(allocator, [5], [3]).tolist() == [4]
    assert free_list(allocator) == [2]
    assert allocator.available_size() == 4


def test_oom_need_sort_merges_release_list_before_giving_up():
    allocator = paged(12, need_sort=True)
    assert allocator.alloc(8).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    allocator.free(i64([4, 5, 6, 7]))
    assert free_list(allocator) == [3, 1]  # free list, then the release list
    assert allocator._num_free == 1  # the release list is merged only when the free list falls short
    assert allocator.available_size() == 8
    out = extend(allocator, [0], [8], [-1])
    assert out.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert free_list(allocator) == []
    assert allocator.check_integrity().ok


# ------------------------------------------------------------------ free groups


def test_paged_free_group_is_one_free_with_duplicates_removed():
    allocator = paged(32)
    allocator.alloc(32)
    allocator.free(page_slots([7, 8]))
    allocator.free_group_begin()
    allocator.free(i64([20]))  # page 5
    allocator.free(i64([4, 5]))  # page 1
    allocator.free(i64([6, 21, 12]))  # pages 1, 5 again and 3
    assert free_list(allocator) == [7, 8]  # nothing freed inside the group
    assert allocator.available_size() == 8
    allocator.free_group_end()
    # One free: sorted and de-duplicated. Three separate frees would give [3, 1, 5, 7, 8].
    assert free_list(allocator) == [1, 3, 5, 7, 8]
    assert allocator.check_integrity().ok


@pytest.mark.parametrize("page_size", [4, 3])  # a power of two (shifted) and not (divided)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("grouped", [False, True])
def test_paged_segment_free_puts_row_order_pages_in_front(page_size, dtype, grouped):
    """`free(..., segment=True)` (0.5.23's free of a row segment): one slot per page taken as
    it comes, pages put back in row order in front of the free list, not sorted; the same from
    a strided view of a request table's row (the slots as the table holds them), in a free
    group (released after the group's other frees), whatever the dtype and page size."""
    allocator = paged(12 * page_size, page_size)
    allocator.alloc(12 * page_size)
    table = torch.zeros(2, 8 * page_size, dtype=dtype)
    table[1, : 3 * page_size] = page_slots([9, 2, 6], page_size).to(dtype)
    segment = table[1, : 3 * page_size]  # a view of the row, as the trees free it
    allocator.free(page_slots([11], page_size))
    if grouped:
        allocator.free_group_begin()
        allocator.free(page_slots([4], page_size))
    allocator.free(segment, segment=True)
    allocator.free(page_slots([7, 3], page_size), segment=True)
    if grouped:
        assert free_list(allocator) == [11]
        allocator.free_group_end()
        # The group's plain frees first (sorted), then its segments in call order, in front.
        assert free_list(allocator) == [9, 2, 6, 7, 3, 4, 11]
    else:
        assert free_list(allocator) == [7, 3, 9, 2, 6, 11]
    assert table[1, : 3 * page_size].tolist() == page_slots([9, 2, 6], page_size).tolist()  # never written
    assert allocator.check_integrity().ok


def test_token_free_group_keeps_free_order():
    allocator = token(8)
    allocator.alloc(8)
    allocator.free_group_begin()
    allocator.free(i64([5]))
    allocator.free(i64([]))
    allocator.free(i64([2, 7]))
    assert free_list(allocator) == []
    allocator.free_group_end()
    assert free_list(allocator) == [5, 2, 7]
    allocator.free_group_begin()
    allocator.free_group_end()  # an empty group frees nothing
    assert free_list(allocator) == [5, 2, 7]


# ------------------------------------------------------------------ backup / restore / clear


@pytest.mark.parametrize("page_size", [1, 4])
def test_backup_restore_round_trip(page_size):
    allocator = make_allocator(32, page_size, CPU, "torch", need_sort=True)
    first = allocator.alloc(12)
    allocator.free(first[: 2 * page_size])
    state = allocator.backup_state()
    assert isinstance(state, AllocatorState)
    before = (free_list(allocator), allocator.available_size(), allocator.in_use_tokens)
    second = allocator.alloc(16)
    allocator.free(first[2 * page_size:])
    allocator.free(second)
    allocator.restore_state(state)
    assert (free_list(allocator), allocator.available_size(), allocator.in_use_tokens) == before
    assert allocator.check_integrity().ok
    assert allocator.alloc(16).tolist() == second.tolist()
    # The snapshot is a copy: restoring it again after more work gives the same state.
    allocator.restore_state(state)
    assert free_list(allocator) == before[0]


def test_backup_restore_across_ring_wrap():
    allocator = token(4)
    allocator.alloc(3)
    allocator.free(i64([2, 1]))
    state = allocator.backup_state()
    assert state.free_pages.tolist() == [4, 2, 1]
    assert allocator.alloc(3).tolist() == [4, 2, 1]
    allocator.restore_state(state)
    assert free_list(allocator) == [4, 2, 1]
    assert allocator.alloc(3).tolist() == [4, 2, 1]


@pytest.mark.parametrize("page_size", [1, 4])
def test_clear(page_size):
    allocator = make_allocator(16, page_size, CPU, "torch", need_sort=True)
    slots = allocator.alloc(8)
    allocator.free(slots[:page_size])
    allocator.free_group_begin()
    allocator.clear()
    assert free_list(allocator) == list(range(1, 16 // page_size + 1))
    assert allocator.available_size() == 16
    assert allocator.in_use_tokens == 0
    allocator.free(i64([]))
    allocator.alloc(page_size)
    allocator.free(i64([page_size]))  # not grouped any more: freed at once
    assert allocator.available_size() == 16
    assert allocator.check_integrity().ok


def test_available_size_is_in_tokens():
    allocator = paged(64, page_size=16)
    assert allocator.available_size() == 64
    assert allocator.num_pages == 4
    extend(allocator, [0], [17], [-1])
    assert allocator.available_size() == 32
    assert allocator.in_use_tokens == 32


def test_size_must_be_a_page_multiple():
    with pytest.raises(ValueError, match="not a multiple of page_size 4"):
        paged(10)


def test_make_allocator_picks_the_class():
    assert type(make_allocator(8, 1, CPU, "torch")) is TokenToKVPoolAllocator
    assert type(make_allocator(8, 4, CPU, "torch")) is PagedTokenToKVPoolAllocator


# ------------------------------------------------------------------ integrity and faults


@pytest.mark.parametrize("page_size", [1, 4])
def test_integrity_passes_normally(page_size):
    allocator = make_allocator(32, page_size, CPU, "torch")
    report = allocator.check_integrity()
    assert report.ok and {c.name for c in report.checks} == ALL_CHECKS
    assert "available 32 + in use 0 vs size 32" in report.check("available + in use == size").detail
    allocator.alloc(8)
    assert allocator.check_integrity().ok


def test_double_free_of_a_page_is_detected():
    allocator = paged(16)
    allocator.alloc(16)
    allocator.free(i64([4]))
    allocator.free(i64([7]))  # same page 1 again, while other pages are still in use
    assert failed_checks(allocator) == {"no duplicate in free list"}
    assert "1 duplicate pages" in allocator.check_integrity().check("no duplicate in free list").detail


def test_double_free_beyond_what_is_allocated_raises():
    allocator = paged(16)
    slots = allocator.alloc(8)
    allocator.free(slots)
    with pytest.raises(ValueError, match="double free"):
        allocator.free(slots)
    assert free_list(allocator) == [1, 2, 3, 4]
    token_allocator = token(4)
    token_allocator.free(token_allocator.alloc(2))
    with pytest.raises(ValueError, match="double free"):
        token_allocator.free(i64([1]))


def test_token_double_free_is_detected():
    allocator = token(8)
    allocator.alloc(4)
    allocator.free(i64([2]))
    allocator.free(i64([2]))
    assert failed_checks(allocator) == {"no duplicate in free list"}


def test_page_zero_in_free_list_is_caught():
    allocator = paged(16)
    allocator.alloc(4)
    allocator.free(i64([1]))  # a slot of the padding page
    assert free_list(allocator) == [0, 2, 3, 4]
    # Page 0 is also outside the valid ids 1..num_pages.
    assert failed_checks(allocator) == {"slot 0 never free", "free list within range"}
    assert allocator.check_integrity().check("slot 0 never free").detail == "page 0 is in the free list"


def test_out_of_range_id_is_caught():
    allocator = paged(16)
    allocator.alloc(4)
    allocator.free(i64([5 * 4 + 1]))  # page 5 of a 4-page pool
    assert failed_checks(allocator) == {"free list within range"}
    token_allocator = token(4)
    token_allocator.alloc(1)
    token_allocator.free(i64([5]))
    assert failed_checks(token_allocator) == {"free list within range"}


def test_conservation_fault_is_caught():
    allocator = paged(16)
    allocator.alloc(4)
    state = allocator.backup_state()
    allocator.restore_state(state._replace(in_use_pages=2))  # one page counted twice
    assert failed_checks(allocator) == {"available + in use == size"}
    detail = allocator.check_integrity().check("available + in use == size").detail
    assert detail == "available 12 + in use 8 vs size 16"
    with pytest.raises(IntegrityError, match="available 12 \\+ in use 8 vs size 16"):
        allocator.check_integrity().raise_if_failed()


def test_debug_mode_checks_after_every_operation(monkeypatch):
    allocator = paged(32, debug=True)
    calls = []
    real_check = allocator.check_integrity
    monkeypatch.setattr(allocator, "check_integrity", lambda: calls.append(1) or real_check())
    slots = allocator.alloc(8)
    extend(allocator, [0], [5], [-1])
    decode(allocator, [6], [20])
    allocator.free(slots)
    assert len(calls) == 4
    assert extend(allocator, [0], [64], [-1]) is None  # a refused allocation changes nothing
    assert len(calls) == 4


def test_debug_mode_raises_on_the_faulty_operation():
    allocator = paged(16, debug=True)
    allocator.alloc(12)
    allocator.free(i64([4, 8]))  # pages 1 and 2
    with pytest.raises(IntegrityError, match="no duplicate in free list"):
        allocator.free(i64([5]))  # page 1 again
    quiet = paged(16)
    quiet.alloc(12)
    quiet.free(i64([4, 8]))
    quiet.free(i64([5]))  # without debug mode nothing is raised
    assert not quiet.check_integrity().ok


def test_free_counters_count_calls_and_tokens_a_group_once():
    alloc = paged(32, page_size=4)
    slots = alloc.alloc(16)
    alloc.free(slots[:4])
    alloc.free_group_begin()
    alloc.free(slots[4:5])
    alloc.free(slots[8:12])
    alloc.free_group_end()
    assert (alloc.num_frees, alloc.freed_tokens) == (2, 4 + 8)
    alloc.free(slots[:0])  # nothing to free: not counted
    assert alloc.num_frees == 2


# ------------------------------------------------------------------ frees of known-distinct pages


def test_paged_free_of_distinct_pages_sorts_like_the_unique_path():
    plain, distinct = paged(48), paged(48)
    for allocator in (plain, distinct):
        allocator.alloc(48)
    plain.free(page_slots([9, 2, 7, 4]))
    # One slot per page, as columns 0, ps, 2 ps, ... of two request rows give (int32, 2-D).
    distinct.free(torch.tensor([[36, 8], [28, 17]], dtype=torch.int32), distinct_pages=True)
    assert free_list(distinct) == free_list(plain) == [2, 4, 7, 9]
    assert distinct.in_use_tokens == plain.in_use_tokens == 8 * 4
    assert distinct.check_integrity().ok


def test_token_free_takes_any_shape_and_int_dtype_in_order():
    allocator = token(6)
    allocator.alloc(6)
    allocator.free(torch.tensor([[5, 1], [3, 6]], dtype=torch.int32), distinct_pages=True)
    assert free_list(allocator) == [5, 1, 3, 6]
    assert allocator.alloc(2).tolist() == [5, 1]
    allocator.free(torch.tensor([[2, 4], [1, 5]], dtype=torch.int32))  # wraps around the ring
    assert free_list(allocator) == [3, 6, 2, 4, 1, 5]
    assert allocator.check_integrity().ok


def test_need_sort_release_list_keeps_int64_copies_of_2d_frees():
    allocator = token(6, need_sort=True)
    allocator.alloc(6)
    rows = torch.tensor([[4, 2], [6, 1]], dtype=torch.int32)
    allocator.free(rows, distinct_pages=True)
    rows.fill_(0)  # the caller's tensor may change afterwards
    assert sorted(free_list(allocator)) == [1, 2, 4, 6]
    allocator.merge_and_sort_free()
    assert free_list(allocator) == [1, 2, 4, 6]


def test_free_group_drops_the_distinct_promise():
    allocator = paged(48)
    allocator.alloc(48)
    with allocator_group(allocator):
        allocator.free(i64([8, 12]), distinct_pages=True)
        allocator.free(i64([9, 13]), distinct_pages=True)  # pages 2 and 3 again
    assert free_list(allocator) == [2, 3]
    assert allocator.in_use_tokens == 10 * 4


def allocator_group(allocator):
    from types import SimpleNamespace

    from memcli.mem_cache.manager import MemoryManager

    pool = SimpleNamespace(device=allocator.device)
    return MemoryManager(SimpleNamespace(req_to_token_pool=pool, allocator=allocator, tree_cache=None)).free_group()


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_extend_write_takes_the_head_or_changes_nothing(monkeypatch, page_size):
    allocator = token(8) if page_size == 1 else paged(8 * 4, page_size)
    table = torch.zeros(2, 40, dtype=torch.int32)
    too_many = allocator.num_pages + 1
    with monkeypatch.context() as patch:
        forbid_kernel(patch, "alloc_extend_write")
        assert allocator.alloc_extend_write(table, [1], i64([0]), i64([too_many * page_size]), [i64([])],
                                            num_pages=too_many) is None
    assert allocator.in_use_tokens == 0 and not table.any()
    got = allocator.alloc_extend_write(table, [1], i64([0]), i64([3 * page_size]), [i64([])], num_pages=3)
    expected = page_slots([1, 2, 3], page_size).tolist()
    assert got.out_cache_loc.tolist() == expected == table[1, : 3 * page_size].tolist()
    assert got.req_pool_indices.tolist() == [1]
    assert free_list(allocator)[0] == 4 and allocator.in_use_tokens == 3 * page_size
    assert allocator.check_integrity().ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_fused_allocations_read_across_the_ring_wrap(backend):
    allocator = token(4, backend=backend)
    assert allocator.alloc(3).tolist() == [1, 2, 3]
    allocator.free(i64([2, 3]))  # free list 4, 2, 3: the last two sit at the buffer's start
    table = torch.zeros(3, 8, dtype=torch.int32)
    seq = i64([0, 5])
    assert allocator.alloc_decode_write(seq, seq.clone(), i64([0, 2]), table).out_cache_loc.tolist() == [4, 2]
    got = allocator.alloc_extend_write(table, [1], i64([0]), i64([1]), [i64([])], num_pages=1)
    assert got.out_cache_loc.tolist() == [3] and table[1, 0] == 3 and table[0, 0] == 4 and table[2, 5] == 2
    assert free_list(allocator) == [] and allocator.check_integrity().ok


def test_paged_need_sort_release_of_distinct_pages_holds_pages():
    allocator = paged(48, need_sort=True)
    allocator.alloc(48)
    allocator.free(torch.tensor([[36, 8], [28, 17]], dtype=torch.int32), distinct_pages=True)
    assert allocator.available_size() == 4 * 4
    allocator.merge_and_sort_free()
    assert free_list(allocator) == [2, 4, 7, 9]
    assert allocator.check_integrity().ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_debug_mode_allocates_with_an_empty_paged_free_list(backend):
    allocator = make_allocator(8, 4, CPU, backend, debug=True)
    table = torch.zeros(2, 8, dtype=torch.int32)
    got = allocator.alloc_extend_write(table, [0], i64([0]), i64([6]), [i64([])], num_pages=2)
    assert got.out_cache_loc.tolist() == [4, 5, 6, 7, 8, 9] and allocator._num_free == 0
    seq = i64([6])  # the new token stays on its page: no page needed from the empty list
    assert allocator.alloc_decode_write(seq, seq.clone(), i64([0]), table).out_cache_loc.tolist() == [10]


def test_a_miscounted_allocation_reads_minus_one_not_a_second_page():
    allocator = paged(16)  # free pages 1..4
    table = torch.zeros(1, 16, dtype=torch.int32)
    seq = i64([0])  # opens a page, but the caller says none
    out = allocator.alloc_decode_write(seq, seq.clone(), i64([0]), table, num_pages=0).out_cache_loc
    assert out.tolist() == [-4] and free_list(allocator) == [1, 2, 3, 4]


def test_distinct_count_matches_unique():
    """The free list's duplicate count (one pass over a scratch array) equals np.unique's,
    ids outside [0, num_pages] included (a corrupted free list may hold them)."""
    import numpy as np

    from memcli.mem_cache.allocator import _distinct_count

    rng = np.random.default_rng(7)
    for n in (1, 5, 300):
        for num_pages in (1, 8, 64):
            ids = rng.integers(-3, num_pages + 4, size=n, dtype=np.int64)
            assert _distinct_count(ids, num_pages) == len(np.unique(ids))
    assert _distinct_count(np.array([3, 3, 3, 9, 9, -1, -1], dtype=np.int32), 4) == 3
    for n in (1, 5, 300):  # every id known in range (the walk's two reductions said so): no masks
        ids = rng.integers(1, 65, size=n, dtype=np.int64)
        assert _distinct_count(ids, 64, in_range=True) == len(np.unique(ids))


def test_duplicate_outside_the_range_is_counted():
    """An id freed twice past the pool's end is both out of range and a duplicate."""
    allocator = token(4)
    allocator.alloc(2)
    allocator.free(i64([6]))
    allocator.free(i64([6]))
    assert failed_checks(allocator) == {"free list within range", "no duplicate in free list"}
    assert allocator.check_integrity().check("no duplicate in free list").detail == "1 duplicate slots"


@pytest.mark.parametrize("ring_start", [0, 50])
def test_a_decode_run_whose_batch_shrinks_takes_each_steps_slots_at_once(ring_start):
    # Four requests, five steps; request 1 leaves at step 2, request 3 at step 4, and each
    # one's slots are freed right after its last step, as a run releases them. One call for
    # the whole run (then the frees) must leave the rows and the free list that a call per
    # step with the batch of that step leaves, frees in between: page size 1 frees go to the
    # free list's tail, behind every slot the run takes. `ring_start` puts the run across the
    # ring's wrap.
    size, steps = 64, 5
    rows = i64([0, 1, 2, 3])
    lengths = i64([3, 9, 1, 6])
    leave_at = [0, 2, 0, 4]  # 1-based step at which the request is no longer in the batch; 0: never

    def fresh():
        alloc = token(size)
        if ring_start:  # the free list's head moved on: the run's entries wrap around its end
            alloc.free(alloc.alloc(ring_start))
        return alloc, torch.zeros(4, 32, dtype=torch.int32)

    def leaver_slots(table, i, n):  # a leaving request's slots of the run, freed after its last step
        return table[i, lengths[i]: lengths[i] + n].to(torch.int64)

    one_by_one, table_a = fresh()
    for step in range(1, steps + 1):
        present = [i for i in range(4) if not leave_at[i] or step < leave_at[i]]
        idx = i64(present)
        seq = lengths[idx] + step - 1
        assert one_by_one.alloc_decode_write(seq, seq, rows[idx], table_a) is not None
        for i in range(4):
            if leave_at[i] == step:
                one_by_one.free(leaver_slots(table_a, i, step - 1))

    at_once, table_b = fresh()
    present = torch.tensor([[not leave_at[i] or step < leave_at[i] for i in range(4)]
                            for step in range(1, steps + 1)]).numpy()
    taken = at_once.alloc_decode_run_leaving_write(lengths, rows, table_b, present)
    assert taken.tolist() == [4, 3, 3, 2, 2]
    for step in range(1, steps + 1):
        for i in range(4):
            if leave_at[i] == step:
                at_once.free(leaver_slots(table_b, i, step - 1))

    assert torch.equal(table_a, table_b)
    assert torch.equal(at_once.free_page_ids(), one_by_one.free_page_ids())
    # 14 slots taken; the leavers gave back theirs from the run: request 1 one, request 3 three
    assert at_once.available_size() == one_by_one.available_size() == size - 14 + 1 + 3


def test_a_paged_decode_run_whose_batch_shrinks_takes_its_pages_up_to_each_release():
    # Page size 4: four requests, six steps; request 1 leaves at step 2 and request 2 at step
    # 5, their slots of the run freed right after those steps: back in front of the free
    # list, where the next steps take them. The run planned at once (`PagedRun`), its pages
    # taken up to and including each step where requests leave, a leaver's row written
    # before its free (which reads it) and the others' at the end, must leave the rows and
    # the free list a call per step leaves.
    ps, steps = 4, 6
    rows = i64([0, 1, 2, 3])
    lengths = i64([3, 8, 5, 2])
    leave_at = [0, 2, 5, 0]

    def fresh():
        alloc, table = paged(96, ps), torch.zeros(4, 32, dtype=torch.int32)
        for i, n in enumerate(lengths.tolist()):  # each row holds its first pages already
            slots = alloc.alloc(-(-n // ps) * ps)
            table[i, :n] = slots[:n].to(torch.int32)
        return alloc, table

    def leavers(step):
        return [i for i in range(4) if leave_at[i] == step]

    def free_leavers(alloc, table, step):
        for i in leavers(step):
            alloc.free(table[i, lengths[i]: lengths[i] + step - 1].to(torch.int64))

    def in_batch(step):
        return [not leave_at[i] or step < leave_at[i] for i in range(4)]

    one_by_one, table_a = fresh()
    for step in range(1, steps + 1):
        idx = i64([i for i, here in enumerate(in_batch(step)) if here])
        seq = lengths[idx] + step - 1
        assert one_by_one.alloc_decode_write(seq, seq, rows[idx], table_a) is not None
        free_leavers(one_by_one, table_a, step)

    stretched, table_b = fresh()
    present = np.array([in_batch(step) for step in range(1, steps + 1)])
    run = stretched.decode_run_leaving(lengths, rows, table_b, present)
    # position len + step - 1 starting a page: request 1's 8 (step 1), 0's 4 (2), 3's 4 (3), 2's 8 (4), 0's 8 (6)
    assert run.opened.tolist() == [1, 1, 1, 1, 0, 1]
    for last in (2, 5, 6):
        run.take(last)
        run.write(np.array(leavers(last), dtype=np.int64), last - 1)
        free_leavers(stretched, table_b, last)
    run.write(np.array([0, 3], dtype=np.int64), steps)

    assert torch.equal(table_a, table_b)
    assert torch.equal(stretched.free_page_ids(), one_by_one.free_page_ids())
    assert stretched.available_size() == one_by_one.available_size()
    # The pages the leavers freed are taken again by the steps after their release.
    freed_at_2 = set((table_a[1, 8:9] // ps).tolist())
    assert freed_at_2 & set(run.pages[2:].tolist())


def test_a_paged_run_takes_nothing_when_its_pages_are_not_free():
    alloc, table = paged(12, 4), torch.zeros(2, 32, dtype=torch.int32)
    for i in range(2):
        table[i, :4] = alloc.alloc(4)[:4].to(torch.int32)
    present = np.ones((9, 2), dtype=bool)  # positions 4..12 of both rows: three pages each, six in all
    run = alloc.decode_run_leaving(i64([4, 4]), i64([0, 1]), table, present)
    before = alloc.free_page_ids().clone()
    with pytest.raises(ValueError, match="need 6 pages, 1 are free"):
        run.take(9)
    assert torch.equal(alloc.free_page_ids(), before)
