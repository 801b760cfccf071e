"""The fused free of whole request rows (`allocator.free_rows`, `kernels.free_rows_triton`)
against the eager free of the rows' page-start columns: same free list, same counters.

On a CPU the triton backend runs under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from memcli import kernels
from memcli.mem_cache.allocator import make_allocator
from memcli.mem_cache.chunk_cache import free_row_pages
from memcli.mem_cache.pools import ReqToTokenPool

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _stack(backend: str, page_size: int, size: int, rows: int = 8, cols: int = 96):
    allocator = make_allocator(size, page_size, DEVICE, backend)
    return allocator, ReqToTokenPool(rows, cols, DEVICE)


def _fill(allocator, pool, rows: list[int], length: int, churn: int) -> None:
    """Give each row `length` slots, as an extend does (position t at offset t % page_size of
    its page), the last row first, after `churn` pages were taken and freed in reverse (so
    that the rows' pages, read row after row, are out of order)."""
    ps = allocator.page_size
    if churn:
        first = allocator.alloc(churn * ps)
        allocator.free(first.flip(0))
    for row in reversed(rows):
        slots = allocator.alloc((length + ps - 1) // ps * ps)
        pool.req_to_token[row, :length] = slots[:length].to(torch.int32)


def _state(allocator):
    return (allocator.free_page_ids().tolist(), allocator.available_size(), allocator._in_use_pages,
            allocator.num_frees, allocator.freed_tokens)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("rows, consecutive", [([3], True), ([1, 2, 3], True), ([5, 0, 2], False)])
def test_fused_free_matches_the_eager_free(page_size, rows, consecutive):
    states = []
    for backend in ("torch", "triton"):
        allocator, pool = _stack(backend, page_size, size=40 * page_size)
        _fill(allocator, pool, rows, length=5 * page_size - 1, churn=3)
        row_index = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
        if backend == "triton":  # the fused path applies here
            assert allocator.free_rows(pool.req_to_token, rows, 5 * page_size - 1, consecutive, row_index)
        else:
            free_row_pages(pool, allocator, rows, 5 * page_size - 1, consecutive=consecutive, row_index=row_index)
        states.append(_state(allocator))
    assert states[0] == states[1]
    assert states[1][2] == 0  # every page back


def test_fused_free_wraps_the_token_ring():
    states = []
    for backend in ("torch", "triton"):
        allocator, pool = _stack(backend, 1, size=24)
        _fill(allocator, pool, [0], length=20, churn=0)  # the ring's tail is near its end
        _fill(allocator, pool, [1], length=3, churn=0)
        free_row_pages(pool, allocator, [0], 20)
        _fill(allocator, pool, [2], length=4, churn=0)
        free_row_pages(pool, allocator, [1, 2], 3, consecutive=True)  # row 2's fourth slot stays
        states.append(_state(allocator))
    assert states[0] == states[1]


def test_fused_free_declines_what_it_does_not_cover():
    allocator, pool = _stack("triton", 16, size=(kernels.FREE_ROWS_SORT_MAX + 32) * 16, cols=16 * 40)
    assert not allocator.free_rows(pool.req_to_token, list(range(8)), 16 * (kernels.FREE_ROWS_SORT_MAX // 8 + 1), True)
    assert not allocator.free_rows(pool.req_to_token, [0, 2], 16, False)  # rows neither consecutive nor given
    torch_allocator, _ = _stack("torch", 16, size=64 * 16)
    assert not torch_allocator.free_rows(pool.req_to_token, [0], 16, True)
    allocator.free_group_begin()
    assert not allocator.free_rows(pool.req_to_token, [0], 16, True)
    allocator.free_group_end()
    assert allocator.num_frees == 0 and allocator.available_size() == allocator.size


def test_fused_free_refuses_a_double_free():
    allocator, pool = _stack("triton", 4, size=64)
    _fill(allocator, pool, [0], length=8, churn=0)
    assert allocator.free_rows(pool.req_to_token, [0], 8, True)
    with pytest.raises(ValueError, match="double free"):
        allocator.free_rows(pool.req_to_token, [0], 8, True)
