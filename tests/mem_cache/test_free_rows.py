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


def _args_block(row0: int, num_rows: int, length: int, page_size: int, dest: int, call: int) -> torch.Tensor:
    per_row = (length + page_size - 1) // page_size
    args = torch.zeros(kernels.FREE_ARGS, dtype=torch.int64, pin_memory=DEVICE.type == "cuda")
    args[:5] = torch.tensor([row0, per_row, num_rows * per_row, dest, call])
    return args


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("row0, num_rows, length", [(3, 1, 19), (1, 3, 64), (0, 2, 1)])
def test_free_from_host_arguments_matches_the_launch(page_size, row0, num_rows, length):
    """`free_rows_planned` (its arguments read from host memory, one program looping over
    blocks) writes what `free_rows_triton` writes, wrapping the ring, and marks its block read."""
    length *= page_size if page_size > 1 else 1
    allocator, pool = _stack("torch", page_size, size=200 * page_size, cols=16 * 70)
    rows = list(range(row0, row0 + num_rows))
    _fill(allocator, pool, rows, length, churn=3)
    cap = allocator._buf.shape[0]
    dest = cap - 2  # the ring wraps
    n = num_rows * ((length + page_size - 1) // page_size)
    block = kernels.free_rows_block(n, page_size)
    launched = torch.full((cap,), -7, dtype=torch.int64, device=DEVICE)
    kernels.free_rows_triton(pool.req_to_token, row0, None, num_rows, length, launched, dest, page_size, page_size > 1)
    planned = torch.full((cap,), -7, dtype=torch.int64, device=DEVICE)
    args = _args_block(row0, num_rows, length, page_size, dest, call=5)
    # A small block for the unsorted free makes the one program loop.
    kernels.free_rows_planned(args.data_ptr(), pool.req_to_token, planned, page_size, block if page_size > 1 else 16)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert planned.tolist() == launched.tolist()
    assert int(args[kernels.FREE_ARG_DONE]) == 5


def test_free_rows_block_declines_what_one_program_does_not_take():
    assert kernels.free_rows_block(kernels.FREE_ROWS_SORT_MAX, 16) == kernels.FREE_ROWS_SORT_MAX
    assert kernels.free_rows_block(kernels.FREE_ROWS_SORT_MAX + 1, 16) is None
    assert kernels.free_rows_block(3, 4) == 16
    assert kernels.free_rows_block(kernels.alloc.FREE_ROWS_LOOP_MAX, 1) == 1024
    assert kernels.free_rows_block(kernels.alloc.FREE_ROWS_LOOP_MAX + 1, 1) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_free_graphs_give_the_launch_free_list(page_size):
    """Frees through `FreeRowsGraphs` (several queued behind a spin, so blocks are reused
    while earlier replays wait) leave the free list and counters of the plain launch."""
    from memcli.mem_cache.free_graph import SLOTS, FreeRowsGraphs
    states, rows = [], list(range(2 * SLOTS + 1))
    for graphs in (False, True):
        allocator, pool = _stack("triton", page_size, size=400 * page_size, rows=16, cols=page_size * 40)
        if graphs:
            allocator.free_graphs = FreeRowsGraphs(allocator._buf, pool.req_to_token, page_size)
        for spin in (False, True):  # the first pass captures; in the second the replays queue behind a spin
            for row in rows:
                _fill(allocator, pool, [row], length=page_size * 3 - 1, churn=1 if row == 0 else 0)
            if spin:
                torch.cuda._sleep(50_000_000)
            for row in rows:
                assert allocator.free_rows(pool.req_to_token, [row], page_size * 3 - 1, True)
            torch.cuda.synchronize()
        if graphs:
            assert allocator.free_graphs.captures == SLOTS and allocator.free_graphs.waits >= 1
        states.append(_state(allocator))
    assert states[0] == states[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_extend_graphs_give_the_launchs_slots_and_rows(page_size):
    """Extends through `ExtendGraphs` (batch sizes of three grids, with and without prefixes,
    several queued behind a spin so blocks are reused while earlier replays wait) leave the
    slots, rows, free list and counters of the plain launch."""
    from memcli.mem_cache.extend_graph import SLOTS, ExtendGraphs
    runs = []
    for graphs in (False, True):
        allocator, pool = _stack("triton", page_size, size=4000 * page_size, rows=40, cols=page_size * 40)
        if graphs:
            allocator.extend_graphs = ExtendGraphs(allocator._buf, pool.req_to_token, page_size)
        seen = []
        for spin in (False, True):
            if spin:
                torch.cuda._sleep(50_000_000)
            # The second pass meets the first's grids, so it captures nothing, and its replays
            # reuse blocks that earlier replays still wait to read.
            for i, bs in enumerate((1, 3, 8, 1, 5, 2, 7, 3)):
                seen.append(_extend(allocator, pool, bs, first_row=i * 4 % 32, prefix=i % 2 == 1))
            torch.cuda.synchronize()
        if graphs:
            assert allocator.extend_graphs.captures == 4 * SLOTS  # grids 1, 4, 8 and 2, each block
            assert allocator.extend_graphs.waits >= 1
        runs.append(([[t.tolist() for t in s] for s in seen], pool.req_to_token.tolist(), _state(allocator)))
    assert runs[0] == runs[1]


def _extend(allocator, pool, bs: int, first_row: int, prefix: bool):
    """One extend of `bs` requests into rows from `first_row`; with `prefix`, each request's
    first slots are an earlier allocation of its own (whole pages, plus one token)."""
    ps = allocator.page_size
    rows = list(range(first_row, first_row + bs))
    prefixes = [allocator.alloc(ps)[: ps - 1 if ps > 1 else 1] if prefix else pool.req_to_token.new_empty(0)
                .long() for _ in rows]
    pre = torch.tensor([p.numel() for p in prefixes], dtype=torch.int64)
    seq = pre + torch.arange(1, bs + 1, dtype=torch.int64) * (ps + 3)
    need = int(((seq + ps - 1) // ps - (pre + ps - 1) // ps).sum())
    written = allocator.alloc_extend_write(pool.req_to_token, rows, pre, seq, prefixes, need)
    return written.out_cache_loc.clone(), written.req_pool_indices.clone(), written.seq_lens.clone()
