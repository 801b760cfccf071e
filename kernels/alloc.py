"""Paged KV-slot allocation, fused: ``alloc_extend_write``, ``alloc_decode_write``, ``alloc_decode_step``.

Each op picks the slots of a batch's new tokens and records them in the request rows of
``req_to_token`` in one launch; these three are the memory path's kernels (the allocator runs
them; ``memcli.mem_cache.decode_graph`` captures ``alloc_decode_step``). Each has its torch
reference beside it (same signature, same validation), which the tests compare it with.

Slots live in pages of ``page_size`` consecutive slots; page ``p`` holds slots
``[p * page_size, (p + 1) * page_size)``. ``free_pages`` is the allocator's free list from its
head (page ids; with ``page_size == 1`` they are slots). These ops only *read* the free list:
the caller knows on the host how many pages a batch takes and advances the list itself.

Layout of one request's new slots in ``alloc_extend_write`` (positions ``pre .. seq-1``)::

    | prefix's last page   | whole new pages ...          | trailing partial page |
    [pre, cdiv(pre,ps)*ps)  [cdiv(pre,ps)*ps, seq//ps*ps)  [seq//ps*ps, seq)
     last_loc+1, +2, ...     free_pages[page_start + j]     last new page

so position ``t`` always sits at offset ``t % ps`` of its page. Entries that would be read past
the end of ``free_pages`` (the caller broke its capacity promise) come out as page ``-1``, i.e.
negative slots, on both backends; no memory outside the free list is ever read.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from ._common import (
    Launcher,
    cdiv,
    check_backend,
    check_count,
    check_page_size,
    check_tensor,
    check_triton_device,
    exclusive_cumsum,
    next_power_of_2,
)

# Tokens per loop step in alloc_extend_write, and the most requests per loop step in the decode kernels.
_EXTEND_BLOCK = 256
# alloc_extend_write runs one program per request. On an H200, alternated in one device call,
# eight programs per request, each taking every eighth block of its tokens, gave a device time
# of 6.3-7.2 µs against 6.9-7.2 at batch size 1, but 14.5-23.7 against 8.5-12.1 at 32 and 27-39
# against 15-28 at 256: every program reads its plan from host memory (docs/PERFORMANCE.md).
_DECODE_BLOCK = 1024


def _decode_block(bs: int) -> int:
    """Requests per loop step of a decode kernel: the batch's next power of two, from 16 up to
    `_DECODE_BLOCK`. A block sized to the batch takes about 1.5 µs less device time per step
    than the widest one (measured on an H200: 3.4 against 5.0 µs at 32 requests), for one
    compile per power of two."""
    return min(_DECODE_BLOCK, max(16, next_power_of_2(bs)))


# ----------------------------------------------------------------------------- the extend layout, in torch


def _extend_offsets(prefix_lens, seq_lens, page_size):
    """Per-request output offset and free-list offset, as exclusive prefix sums (no sync)."""
    out_start = exclusive_cumsum(seq_lens - prefix_lens)
    page_start = exclusive_cumsum(cdiv(seq_lens, page_size) - cdiv(prefix_lens, page_size))
    return out_start, page_start


def _extend_slots_torch(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                        free_pages: torch.Tensor, page_size: int, extend_num_tokens: int) -> torch.Tensor:
    """The new slots of an extend batch (int64, ``extend_num_tokens``): the slot half of
    :func:`alloc_extend_write_torch`, on inputs it built (not validated).

    Request ``i`` (prefix length ``prefix_lens[i]``, new length ``seq_lens[i]``, ``last_loc[i]``
    the slot of its last prefix token or -1; on a CPU ``last_loc`` may be a list) gets ``out[off_i : off_i + seq_i - pre_i]`` with
    ``off_i = sum(seq_j - pre_j for j < i)``, and consumes
    ``free_pages[page_start_i : page_start_i + new_pages_i]`` where
    ``new_pages_j = cdiv(seq_j, ps) - cdiv(pre_j, ps)`` and ``page_start_i`` is their
    exclusive prefix sum; pages past the end of ``free_pages`` read as page -1.

    Example (ps 4, free_pages [1, 2, 3, 4, ...]; (pre, seq, last_loc) = (0, 6, -1),
    (5, 11, 40), (8, 9, 47)): ``[4, 5, 6, 7, 8, 9, 41, 42, 43, 12, 13, 14, 16]``.
    """
    device, bs = prefix_lens.device, prefix_lens.shape[0]
    if bs == 0 or extend_num_tokens == 0:
        return torch.empty(extend_num_tokens, dtype=torch.int64, device=device)
    if device.type == "cpu":
        return _alloc_extend_rows_cpu(prefix_lens, seq_lens, last_loc, free_pages, page_size, extend_num_tokens)
    return _alloc_extend_tokens(prefix_lens, seq_lens, last_loc, free_pages, page_size, extend_num_tokens)


def _alloc_extend_tokens(prefix_lens, seq_lens, last_loc, free_pages, page_size: int,
                         extend_num_tokens: int) -> torch.Tensor:
    """``_extend_slots_torch`` as passes over every token, with no host sync (any device)."""
    device, bs = prefix_lens.device, prefix_lens.shape[0]
    out_start, page_start = _extend_offsets(prefix_lens, seq_lens, page_size)
    req = torch.repeat_interleave(
        torch.arange(bs, device=device), seq_lens - prefix_lens, output_size=extend_num_tokens
    )
    k = torch.arange(extend_num_tokens, device=device) - out_start[req]
    pos = prefix_lens[req] + k
    first_new_page = cdiv(prefix_lens, page_size)[req]
    on_new_page = pos >= first_new_page * page_size
    page_idx = page_start[req] + pos // page_size - first_new_page
    page = _gather_or_minus_one(free_pages, page_idx)
    return torch.where(on_new_page, page * page_size + pos % page_size, last_loc[req] + 1 + k)


def _alloc_extend_rows_cpu(prefix_lens, seq_lens, last_loc, free_pages, page_size: int,
                           extend_num_tokens: int) -> torch.Tensor:
    """``_extend_slots_torch`` request by request, on a CPU, where reading the lengths costs
    nothing. A request's new tokens are the rest of its last prefix page (the slots after
    ``last_loc``), then a run of its new pages laid out slot by slot; with every new page
    expanded once, that run is one slice. So two slice copies per request replace a dozen
    passes over every token, all in numpy over the tensors' memory (torch's cost per small
    operation was most of a paged extend's). Pages past the free list read as page -1, as in
    the vectorised path; tokens past ``extend_num_tokens`` are not written."""
    ps = page_size
    pre, seq = prefix_lens.tolist(), seq_lens.tolist()
    last = last_loc.tolist() if isinstance(last_loc, torch.Tensor) else last_loc
    new_pages = [cdiv(s, ps) - cdiv(p, ps) for p, s in zip(pre, seq)]
    total = sum(new_pages)
    pages = free_pages.numpy()[:total]
    if pages.shape[0] < total:
        pages = np.concatenate([pages, np.full(total - pages.shape[0], -1, dtype=pages.dtype)])
    expanded = (pages[:, None] * ps + np.arange(ps, dtype=pages.dtype)).reshape(-1)
    out = np.full(extend_num_tokens, -1, dtype=np.int64)
    off = page_off = 0
    for p, s, loc, taken in zip(pre, seq, last, new_pages):
        if off >= extend_num_tokens:
            break
        n = min(s - p, extend_num_tokens - off)
        part1 = min(n, cdiv(p, ps) * ps - p)  # the rest of the prefix's last page
        if part1:
            out[off : off + part1] = np.arange(loc + 1, loc + 1 + part1)
        if n > part1:
            out[off + part1 : off + n] = expanded[page_off * ps : page_off * ps + n - part1]
        off += n
        page_off += taken
    return torch.from_numpy(out)


def _gather_or_minus_one(values: torch.Tensor, idx: torch.Tensor, start: int = 0,
                         count: int | None = None) -> torch.Tensor:
    """Entry ``idx`` of the ring of ``count`` entries (default: all) that starts at ``values[start]``
    where ``0 <= idx < count``, else -1 (matches the kernels' masks)."""
    cap = values.shape[0]
    count = cap if count is None else count
    if cap == 0 or count == 0:
        return torch.full_like(idx, -1)
    in_range = (idx >= 0) & (idx < count)
    ring = idx.clamp(0, count - 1) + start
    ring = torch.where(ring >= cap, ring - cap, ring)
    return torch.where(in_range, values[ring], -1)


def _write_rows_torch(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_flat) -> None:
    """Each request's prefix slots and new slots into its ``req_to_token`` row (int32): row
    ``req_pool_indices[i]`` gets ``prefix_flat[poff_i : poff_i + pre_i]`` in columns
    ``[0, pre_i)`` and ``out_cache_loc[off_i : off_i + seq_i - pre_i]`` in ``[pre_i, seq_i)``,
    ``poff`` and ``off`` being exclusive prefix sums of ``prefix_lens`` and ``seq_lens -
    prefix_lens``; the rest of the row is untouched. The row half of
    :func:`alloc_extend_write_torch`, on inputs it built (not validated)."""
    if req_pool_indices.shape[0] == 0:
        return
    if req_to_token.device.type == "cpu":
        _write_rows_cpu(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_flat)
        return
    # One (row, column, value) triple per written cell; the sizes are the flat tensors'
    # lengths, so no host sync is needed to build them.
    rows_pre, cols_pre = _cells(req_pool_indices, torch.zeros_like(prefix_lens), prefix_lens,
                                prefix_flat.shape[0])
    rows_new, cols_new = _cells(req_pool_indices, prefix_lens, seq_lens, out_cache_loc.shape[0])
    req_to_token[rows_pre, cols_pre] = prefix_flat.to(torch.int32)
    req_to_token[rows_new, cols_new] = out_cache_loc.to(torch.int32)


def _write_rows_cpu(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_flat):
    """The same writes as two slice copies per request: on a CPU reading the lengths costs
    nothing, and slices beat building an index per cell."""
    pre_off = new_off = 0
    for row, pre, seq in zip(req_pool_indices.tolist(), prefix_lens.tolist(), seq_lens.tolist()):
        dest = req_to_token[row]
        if pre:  # an empty slice copy still costs a dispatch
            dest[:pre] = prefix_flat[pre_off : pre_off + pre]
        dest[pre:seq] = out_cache_loc[new_off : new_off + seq - pre]
        pre_off += pre
        new_off += seq - pre


def _cells(req_pool_indices, begin, end, total):
    """Row and column of every cell in ``[begin_i, end_i)`` of row ``req_pool_indices[i]``."""
    lens = end - begin
    req = torch.repeat_interleave(
        torch.arange(lens.shape[0], device=lens.device), lens, output_size=total
    )
    within = torch.arange(total, device=lens.device) - exclusive_cumsum(lens)[req]
    return req_pool_indices[req], begin[req] + within


# ----------------------------------------------------------------------------- decode slots (both decode ops)


@triton.jit
def _ring(index, cap):
    """``index`` wrapped once into ``[0, cap)`` (free lists are read as rings)."""
    return tl.where(index >= cap, index - cap, index)


@triton.jit
def _decode_slots(
    mask,
    needs_page,
    last_loc,
    pages_before,
    free_pages_ptr,
    free_start,
    free_cap,
    num_free_pages,
    PAGE_SIZE: tl.constexpr,
):
    """Slots of one block of decode requests; returns (slots, pages this block takes)."""
    needs = needs_page & mask
    needs_i64 = needs.to(tl.int64)
    page_idx = pages_before + tl.cumsum(needs_i64, axis=0) - needs_i64
    page = tl.load(free_pages_ptr + _ring(free_start + page_idx, free_cap),
                   mask=needs & (page_idx < num_free_pages), other=-1)
    slot = tl.where(needs, page * PAGE_SIZE, last_loc + 1)
    return slot, tl.sum(needs_i64, axis=0)


def _decode_slots_torch(needs_page, last_loc, free_pages, page_size, free_start=0, num_free=None):
    needs = needs_page.to(torch.int64)
    page = _gather_or_minus_one(free_pages, exclusive_cumsum(needs), free_start, num_free)
    return torch.where(needs_page, page * page_size, last_loc + 1)


# ----------------------------------------------------------------------------- alloc_decode_write


_DECODE_WRITE_RUNTIME = ["seq_lens_before_ptr", "req_pool_indices_ptr", "req_to_token_ptr", "free_pages_ptr",
                         "out_ptr", "bs", "free_start", "free_cap", "num_free_pages", "row_stride"]


@triton.jit
def _decode_write_block(
    i,
    bs,
    seq_lens_before_ptr,
    req_pool_indices_ptr,
    req_to_token_ptr,
    row_stride,
    pages_before,
    free_pages_ptr,
    free_start,
    free_cap,
    num_free_pages,
    PAGE_SIZE: tl.constexpr,
):
    """One block of a decode step: each request's new slot, written at column `seq` of its
    row. Returns (mask, seq, slot, pages this block takes)."""
    mask = i < bs
    seq = tl.load(seq_lens_before_ptr + i, mask=mask, other=0)
    row = req_to_token_ptr + tl.load(req_pool_indices_ptr + i, mask=mask, other=0) * row_stride
    needs_page = seq % PAGE_SIZE == 0
    # Column seq - 1 is only read when the new token shares its page (so seq >= 1).
    last_loc = tl.load(row + seq - 1, mask=mask & ~needs_page, other=0).to(tl.int64)
    slot, taken = _decode_slots(
        mask, needs_page, last_loc, pages_before, free_pages_ptr, free_start, free_cap, num_free_pages, PAGE_SIZE,
    )
    tl.store(row + seq, slot.to(tl.int32), mask=mask)
    return mask, seq, slot, taken


@triton.jit(do_not_specialize=_DECODE_WRITE_RUNTIME, do_not_specialize_on_alignment=_DECODE_WRITE_RUNTIME)
def _alloc_decode_write_kernel(
    seq_lens_before_ptr,
    req_pool_indices_ptr,
    req_to_token_ptr,
    free_pages_ptr,
    out_ptr,
    bs: tl.int64,
    free_start: tl.int64,
    free_cap: tl.int64,
    num_free_pages: tl.int64,
    row_stride: tl.int64,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pages_before = tl.full([], 0, tl.int64)
    for start in range(0, bs, BLOCK):
        i = start + tl.arange(0, BLOCK)
        mask, seq, slot, taken = _decode_write_block(
            i, bs, seq_lens_before_ptr, req_pool_indices_ptr, req_to_token_ptr, row_stride, pages_before,
            free_pages_ptr, free_start, free_cap, num_free_pages, PAGE_SIZE,
        )
        tl.store(out_ptr + i, slot, mask=mask)
        pages_before += taken


_alloc_decode_write_launch = Launcher(_alloc_decode_write_kernel)


def _check_free_ring(free_pages, free_start, num_free, device):
    """The free list: ``num_free`` entries of ``free_pages`` read as a ring from ``free_start``."""
    check_tensor("free_pages", free_pages, device=device, contiguous=True)
    cap = free_pages.shape[0]
    check_count("free_start", free_start)
    check_count("num_free", num_free)
    # free_start == cap is a ring starting at its end (an allocator whose stack is empty).
    if free_start > cap or num_free > cap:
        raise ValueError(f"free_start {free_start} and num_free {num_free} do not fit a free list of {cap} entries")


def _ring_slice(free_pages, free_start, n):
    """The first ``n`` entries of the ring from ``free_start`` (a view unless they wrap)."""
    end = free_start + n
    if end <= free_pages.shape[0]:
        return free_pages[free_start:end]
    return torch.cat([free_pages[free_start:], free_pages[: end - free_pages.shape[0]]])


def _ring_copy_host(values: np.ndarray, free_start: int, n: int) -> np.ndarray:
    """``_ring_slice`` of a free list's numpy view, as a new array (the ring positions are
    rewritten by later frees)."""
    end = free_start + n
    if end <= values.shape[0]:
        return values[free_start:end].copy()
    return np.concatenate((values[free_start:], values[: end - values.shape[0]]))


def _check_alloc_decode_write(
    seq_lens_before, req_pool_indices, req_to_token, free_pages, page_size, free_start, num_free
):
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, ndim=2)
    device = req_to_token.device
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token rows must be contiguous (stride(1) == 1)")
    check_tensor("seq_lens_before", seq_lens_before, device=device, contiguous=True)
    bs = seq_lens_before.shape[0]
    check_tensor("req_pool_indices", req_pool_indices, device=device, length=bs, contiguous=True)
    _check_free_ring(free_pages, free_start, num_free, device)
    check_page_size(page_size)


def alloc_decode_write_triton(
    seq_lens_before: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    validate: bool = True,
    free_start: int = 0,
    num_free: int | None = None,
) -> torch.Tensor:
    """Triton ``alloc_decode_write`` (one launch); see :func:`alloc_decode_write`."""
    cap = free_pages.shape[0]
    num_free = cap if num_free is None else num_free
    if validate:
        _check_alloc_decode_write(seq_lens_before, req_pool_indices, req_to_token, free_pages, page_size,
                                  free_start, num_free)
        check_triton_device(req_to_token.device, _alloc_decode_write_kernel)
    bs = seq_lens_before.shape[0]
    out = torch.empty(bs, dtype=torch.int64, device=req_to_token.device)
    if bs == 0:
        return out
    _alloc_decode_write_launch(
        (1,), seq_lens_before, req_pool_indices, req_to_token, free_pages, out,
        bs, free_start, cap, num_free, req_to_token.stride(0), page_size, _decode_block(bs),
    )
    return out


def alloc_decode_write_torch(
    seq_lens_before: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    validate: bool = True,
    free_start: int = 0,
    num_free: int | None = None,
) -> torch.Tensor:
    """Torch reference of ``alloc_decode_write``; see :func:`alloc_decode_write`."""
    num_free = free_pages.shape[0] if num_free is None else num_free
    if validate:
        _check_alloc_decode_write(seq_lens_before, req_pool_indices, req_to_token, free_pages, page_size,
                                  free_start, num_free)
    bs = seq_lens_before.shape[0]
    on_cpu = req_to_token.device.type == "cpu"
    if page_size == 1 and bs <= num_free:  # every request takes the next free slot
        if on_cpu:
            return _alloc_decode_write_flat_cpu(seq_lens_before, req_pool_indices, req_to_token, free_pages,
                                                free_start, bs)
        out = _ring_slice(free_pages, free_start, bs).clone()
        req_to_token[req_pool_indices, seq_lens_before] = out.to(torch.int32)
        return out
    if on_cpu:
        return _alloc_decode_write_cpu(seq_lens_before, req_pool_indices, req_to_token, free_pages, page_size,
                                       free_start, num_free)
    needs_page = seq_lens_before % page_size == 0
    prev_col = (seq_lens_before - 1).clamp(min=0)
    last_loc = req_to_token[req_pool_indices, prev_col].to(torch.int64)
    out = _decode_slots_torch(needs_page, last_loc, free_pages, page_size, free_start, num_free)
    req_to_token[req_pool_indices, seq_lens_before] = out.to(torch.int32)
    return out


def _alloc_decode_write_flat_cpu(seq_lens_before, req_pool_indices, req_to_token, free_pages, free_start: int,
                                 bs: int) -> torch.Tensor:
    """``alloc_decode_write_torch`` at page size 1 on a CPU, the free list holding ``bs``
    entries: the next ``bs`` entries of the ring (a copy), written at column
    ``seq_lens_before[i]`` of row ``req_pool_indices[i]``. In numpy over the tensors' own
    memory: measured inside a replay, the views and one fancy assignment take about half the
    time of torch's copy and indexed write (the request rows are scattered over a large
    table, and torch's indexing adds its own setup to every miss)."""
    out = _ring_copy_host(free_pages.numpy(), free_start, bs)
    req_to_token.numpy()[req_pool_indices.numpy(), seq_lens_before.numpy()] = out  # int64 -> int32, as .to()
    return torch.from_numpy(out)


def _alloc_decode_write_cpu(seq_lens_before, req_pool_indices, req_to_token, free_pages, page_size: int,
                            free_start: int, num_free: int) -> torch.Tensor:
    """``alloc_decode_write_torch`` on a CPU, in numpy over the tensors' own memory: the paged
    step is a few small array operations, and numpy's cost per operation is a fraction of
    torch's (page size 1 with the pages at hand: ``_alloc_decode_write_flat_cpu``). The same
    slots: the requests whose length is a multiple of the page size take, in batch order, the
    next pages of the ring of ``num_free`` entries from ``free_start`` (page -1 past it), the
    others the slot after their last one."""
    seq, rows, table = seq_lens_before.numpy(), req_pool_indices.numpy(), req_to_token.numpy()
    values, cap = free_pages.numpy(), free_pages.shape[0]
    out = table[rows, np.maximum(seq - 1, 0)].astype(np.int64)
    out += 1
    takers = np.flatnonzero(seq % page_size == 0)
    if takers.shape[0]:
        have = min(takers.shape[0], num_free) if cap else 0
        page = _ring_copy_host(values, free_start, have)
        if have < takers.shape[0]:
            page = np.concatenate((page, np.full(takers.shape[0] - have, -1, dtype=page.dtype)))
        out[takers] = page * page_size
    table[rows, seq] = out
    return torch.from_numpy(out)


def alloc_decode_write(
    seq_lens_before: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    backend: str = "triton",
    validate: bool = True,
    free_start: int = 0,
    num_free: int | None = None,
) -> torch.Tensor:
    """Fused decode memory step: pick each request's new slot and record it in ``req_to_token``.

    ``seq_lens_before`` are lengths *before* the new token, which goes to column
    ``seq_lens_before[i]`` of row ``req_pool_indices[i]``. The slot follows
    ``seq_before % ps == 0`` opens a page: the request gets ``free_pages[k] * ps`` with ``k``
    the number of earlier requests that open one; else ``req_to_token[row, seq - 1] + 1``, the
    slot after its last one. Mutates ``req_to_token`` (that one column per request, int32)
    and returns the slots (int64, ``bs``); with ``ps == 1`` they are the first ``bs`` free
    entries. The free list is read, not advanced: ``num_free`` entries (default: all) of
    ``free_pages`` read as a ring from ``free_start`` (wrapping to index 0), so an allocator
    passes its whole buffer and its head instead of slicing it. The caller guarantees
    ``seq_before`` is a valid column and the free list holds enough pages (entries past
    ``num_free`` read as page -1). No host sync; the triton backend is one launch. Raises
    ``ValueError`` on bad input; ``validate=False`` skips the checks (for callers whose
    inputs are right by construction).
    """
    check_backend(backend)
    fn = alloc_decode_write_triton if backend == "triton" else alloc_decode_write_torch
    return fn(seq_lens_before, req_pool_indices, req_to_token, free_pages, page_size, validate, free_start, num_free)


# ----------------------------------------------------------------------------- alloc_decode_step

# The free list's head and length as one int64 on the device: head << 32 | length. One value,
# so a host that moved the head can set it with a single fill (a launch, no copy, no sync).
_STATE_SHIFT = 32
_STATE_MASK = (1 << _STATE_SHIFT) - 1


def pack_free_state(head: int, num_free: int) -> int:
    """The device-side free-list state of :func:`alloc_decode_step`."""
    if not (0 <= head <= _STATE_MASK and 0 <= num_free <= _STATE_MASK):
        raise ValueError(f"free-list head {head} / length {num_free} do not fit in 32 bits")
    return head << _STATE_SHIFT | num_free


def unpack_free_state(state: int) -> tuple[int, int]:
    """(head, length) of a packed state."""
    return state >> _STATE_SHIFT, state & _STATE_MASK


_DECODE_STEP_RUNTIME = ["seq_lens_ptr", "req_pool_indices_ptr", "req_to_token_ptr", "free_pages_ptr", "out_ptr",
                        "state_ptr", "bs", "free_cap", "row_stride"]


@triton.jit(do_not_specialize=_DECODE_STEP_RUNTIME, do_not_specialize_on_alignment=_DECODE_STEP_RUNTIME)
def _alloc_decode_step_kernel(
    seq_lens_ptr,
    req_pool_indices_ptr,
    req_to_token_ptr,
    free_pages_ptr,
    out_ptr,
    state_ptr,
    bs: tl.int64,
    free_cap: tl.int64,
    row_stride: tl.int64,
    PAGE_SIZE: tl.constexpr,
    RING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    state = tl.load(state_ptr)
    free_start = state >> 32
    num_free = state & 0xFFFFFFFF
    pages_before = tl.full([], 0, tl.int64)
    for start in range(0, bs, BLOCK):
        i = start + tl.arange(0, BLOCK)
        mask, seq, slot, taken = _decode_write_block(
            i, bs, seq_lens_ptr, req_pool_indices_ptr, req_to_token_ptr, row_stride, pages_before,
            free_pages_ptr, free_start, free_cap, num_free, PAGE_SIZE,
        )
        tl.store(out_ptr + i, slot, mask=mask)
        tl.store(seq_lens_ptr + i, seq + 1, mask=mask)
        pages_before += taken
    head = free_start + pages_before
    if RING:
        head = _ring(head, free_cap)
    tl.store(state_ptr, (head << 32) | (num_free - pages_before))


_alloc_decode_step_launch = Launcher(_alloc_decode_step_kernel)


def _check_alloc_decode_step(seq_lens, req_pool_indices, req_to_token, free_pages, state, page_size, out):
    check_tensor("state", state, dtype=torch.int64, device=req_to_token.device, length=1)
    head, num_free = unpack_free_state(int(state.item()))
    _check_alloc_decode_write(seq_lens, req_pool_indices, req_to_token, free_pages, page_size, head, num_free)
    if out is not None:
        check_tensor("out", out, dtype=torch.int64, device=req_to_token.device, length=seq_lens.shape[0],
                     contiguous=True)


def alloc_decode_step_triton(
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    free_pages: torch.Tensor,
    state: torch.Tensor,
    page_size: int,
    ring: bool,
    out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Triton ``alloc_decode_step`` (one launch, no host arithmetic); see :func:`alloc_decode_step`."""
    if validate:
        _check_alloc_decode_step(seq_lens, req_pool_indices, req_to_token, free_pages, state, page_size, out)
        check_triton_device(req_to_token.device, _alloc_decode_step_kernel)
    bs = seq_lens.shape[0]
    if out is None:
        out = torch.empty(bs, dtype=torch.int64, device=req_to_token.device)
    if bs == 0:
        return out
    _alloc_decode_step_launch(
        (1,), seq_lens, req_pool_indices, req_to_token, free_pages, out, state,
        bs, free_pages.shape[0], req_to_token.stride(0), page_size, bool(ring), _decode_block(bs),
    )
    return out


def alloc_decode_step_torch(
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    free_pages: torch.Tensor,
    state: torch.Tensor,
    page_size: int,
    ring: bool,
    out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Torch reference of ``alloc_decode_step``; see :func:`alloc_decode_step`."""
    if validate:
        _check_alloc_decode_step(seq_lens, req_pool_indices, req_to_token, free_pages, state, page_size, out)
    head, num_free = unpack_free_state(int(state.item()))
    taken = int(((seq_lens % page_size) == 0).sum())
    slots = alloc_decode_write_torch(seq_lens, req_pool_indices, req_to_token, free_pages, page_size, False,
                                     head, num_free)
    if out is None:
        out = slots
    else:
        out.copy_(slots)
    seq_lens.add_(1)
    head += taken
    if ring:
        head %= free_pages.shape[0]
    state.fill_(pack_free_state(head, num_free - taken))
    return out


def alloc_decode_step(
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    free_pages: torch.Tensor,
    state: torch.Tensor,
    page_size: int,
    ring: bool,
    out: torch.Tensor | None = None,
    backend: str = "triton",
    validate: bool = True,
) -> torch.Tensor:
    """A whole decode step of the memory path with the free list's state on the device.

    Like :func:`alloc_decode_write` (each request's slot at column ``seq_lens[i]`` of row
    ``req_pool_indices[i]``), but the free list's head and length are read from ``state``
    (one int64, :func:`pack_free_state`) and written back advanced by the pages taken, and
    ``seq_lens`` is incremented in place. With every input on the device and ``out`` given,
    a call needs no host value at all, so it can be captured once in a CUDA graph and
    replayed step after step. ``ring``: the free list is a ring (page size 1 allocator: the
    head wraps), else a stack (the head only grows). The caller guarantees the free list
    holds the pages the step opens. Returns ``out`` (int64, ``bs``).
    """
    check_backend(backend)
    fn = alloc_decode_step_triton if backend == "triton" else alloc_decode_step_torch
    return fn(seq_lens, req_pool_indices, req_to_token, free_pages, state, page_size, ring, out, validate)


# ----------------------------------------------------------------------------- alloc_extend_write

# The plan of an extend batch: six rows of bs int64 values, flattened. The host computes
# every offset (new tokens and new pages of the requests before each one), so each program
# reads its own six values and nothing else.
_PLAN_PRE, _PLAN_SEQ, _PLAN_ROW, _PLAN_PREFIX_PTR, _PLAN_OUT_START, _PLAN_PAGE_START = range(6)
_PLAN_ROWS = 6
# The batch's lengths and rows the kernel copies to the device beside the new slots.
_DEVICE_ROWS = 3


class ExtendWrite(NamedTuple):
    """What ``alloc_extend_write`` leaves on the device: the new slots, and the batch's rows,
    prefix lengths and sequence lengths (on the triton backend, written by the kernel into
    the allocation of the slots)."""

    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    seq_lens: torch.Tensor


class PlanArena:
    """Host memory that the extend kernel reads its plan from, with no copy to the device.

    On CUDA the arena is pinned, so the kernel loads the plan through the host address
    (mapped memory under unified addressing): the prefill's memory path is then one launch,
    where an upload from pageable memory would be a copy the host waits on. Plans are
    carved one after another from one of ``SEGMENTS`` segments; when a plan does not fit in
    the current segment, an event is recorded on the current stream (after every launch that
    read the segment) and the next segment is reused only once its event has completed,
    which it long has in a steady loop (a wait otherwise, never a wrong read). A plan larger
    than a segment grows the arena, after the device finished with the old one. Under
    Triton's interpreter (CPU tensors) the arena is plain host memory: the kernel runs
    before the call returns.
    """

    SEGMENTS = 4

    def __init__(self, segment: int = 16384):
        self._segment = segment
        self._host: torch.Tensor | None = None
        self._array: np.ndarray | None = None
        self._address = 0
        self._cuda = False
        self._events: list = [None] * self.SEGMENTS
        self._current, self._offset = 0, 0

    def take(self, n: int, device: torch.device) -> tuple[np.ndarray, int]:
        """``n`` int64 entries to fill before the launch, and their address."""
        cuda = device.type == "cuda"
        if self._host is None or n > self._segment or cuda != self._cuda:
            self._allocate(max(n, self._segment), cuda)
        if self._offset + n > self._segment:
            self._next_segment()
        start = self._current * self._segment + self._offset
        self._offset += n
        return self._array[start : start + n], self._address + 8 * start

    def _allocate(self, segment: int, cuda: bool) -> None:
        if self._host is not None and self._cuda:
            torch.cuda.synchronize()  # every launch that reads the old arena has run
        self._segment, self._cuda = segment, cuda
        self._host = torch.empty(segment * self.SEGMENTS, dtype=torch.int64, pin_memory=cuda)
        self._array = self._host.numpy()
        self._address = self._host.data_ptr()
        self._events = [None] * self.SEGMENTS
        self._current, self._offset = 0, 0

    def _next_segment(self) -> None:
        if self._cuda:
            event = self._events[self._current] or torch.cuda.Event()
            event.record()
            self._events[self._current] = event
        self._current = (self._current + 1) % self.SEGMENTS
        self._offset = 0
        waiting = self._events[self._current]
        if waiting is not None and not waiting.query():
            waiting.synchronize()


_plan_arena = PlanArena()


_EXTEND_WRITE_RUNTIME = ["plan_address", "req_to_token_ptr", "free_pages_ptr", "out_ptr", "bs", "free_start",
                         "free_cap", "num_free_pages", "row_stride", "out_numel"]


@triton.jit
def _extend_write_request(plan_ptr, plan_stride, pid, active, bs, req_to_token_ptr, free_pages_ptr, out_ptr,
                          free_start, free_cap, num_free_pages, row_stride, out_numel, PAGE_SIZE: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Request `pid` of an extend batch of `bs`: its plan entries (see _PLAN_*, one row of
    `plan_stride` entries each, read from host memory: prefix length, sequence length, request
    row, prefix address, and the new tokens and new pages of the requests before it), its
    lengths and row beside the new slots in `out`, its prefix and new slots in its
    `req_to_token` row. An inactive program (past the batch) reads its entries and writes nothing."""
    pre = tl.where(active, tl.load(plan_ptr + pid), 0)
    seq = tl.where(active, tl.load(plan_ptr + plan_stride + pid), 0)
    row = tl.load(plan_ptr + 2 * plan_stride + pid)
    prefix_ptr = tl.load(plan_ptr + 3 * plan_stride + pid).to(tl.pointer_type(tl.int64))
    out_start = tl.load(plan_ptr + 4 * plan_stride + pid)
    page_start = tl.load(plan_ptr + 5 * plan_stride + pid)
    row_ptr = req_to_token_ptr + row * row_stride

    # The batch's lengths and rows on the device, before the new slots: [pre | seq | rows | out].
    tl.store(out_ptr + pid, pre, mask=active)
    tl.store(out_ptr + bs + pid, seq, mask=active)
    tl.store(out_ptr + 2 * bs + pid, row, mask=active)
    slots_ptr = out_ptr + 3 * bs

    # Columns [0, pre): the prefix slots, narrowed to int32.
    for start in range(0, pre, BLOCK):
        k = start + tl.arange(0, BLOCK)
        mask = k < pre
        tl.store(row_ptr + k, tl.load(prefix_ptr + k, mask=mask).to(tl.int32), mask=mask)

    # Columns [pre, seq): new slots, the layout of the module docstring.
    last_loc = tl.load(prefix_ptr + pre - 1, mask=pre > 0, other=-1)
    first_new_page = (pre + PAGE_SIZE - 1) // PAGE_SIZE
    first_new_pos = first_new_page * PAGE_SIZE
    extend_len = seq - pre
    for start in range(0, extend_len, BLOCK):
        k = start + tl.arange(0, BLOCK)
        mask = (k < extend_len) & (out_start + k < out_numel)  # never past `out`, whatever the plan says
        pos = pre + k
        on_new_page = pos >= first_new_pos
        page_idx = page_start + pos // PAGE_SIZE - first_new_page
        page = tl.load(free_pages_ptr + _ring(free_start + page_idx, free_cap),
                       mask=mask & on_new_page & (page_idx < num_free_pages), other=-1)
        slot = tl.where(on_new_page, page * PAGE_SIZE + pos % PAGE_SIZE, last_loc + 1 + k)
        tl.store(slots_ptr + out_start + k, slot, mask=mask)
        tl.store(row_ptr + pos, slot.to(tl.int32), mask=mask)


@triton.jit(do_not_specialize=_EXTEND_WRITE_RUNTIME, do_not_specialize_on_alignment=_EXTEND_WRITE_RUNTIME)
def _alloc_extend_write_kernel(
    plan_address,
    req_to_token_ptr,
    free_pages_ptr,
    out_ptr,
    bs: tl.int64,
    free_start: tl.int64,
    free_cap: tl.int64,
    num_free_pages: tl.int64,
    row_stride: tl.int64,
    out_numel: tl.int64,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per request.
    pid = tl.program_id(0)
    _extend_write_request(plan_address.to(tl.pointer_type(tl.int64)), bs, pid, pid < bs, bs, req_to_token_ptr,
                          free_pages_ptr, out_ptr, free_start, free_cap, num_free_pages, row_stride, out_numel,
                          PAGE_SIZE, BLOCK)


_alloc_extend_write_launch = Launcher(_alloc_extend_write_kernel)

# An extend from an argument block in host memory (what a captured graph replays): a header
# of EXTEND_ARGS_HEADER int64 (the batch size, the free list's head and length, the output's
# address and length, the call's number), then the plan (_PLAN_* rows of the batch size).
EXTEND_ARG_BS, EXTEND_ARG_FREE_START, EXTEND_ARG_NUM_FREE, EXTEND_ARG_OUT, EXTEND_ARG_OUT_NUMEL, EXTEND_ARG_CALL = \
    range(6)
EXTEND_ARGS_HEADER = 8

_EXTEND_PLANNED_RUNTIME = ["args_address", "started_address", "req_to_token_ptr", "free_pages_ptr", "free_cap",
                           "row_stride", "plan_stride"]


@triton.jit(do_not_specialize=_EXTEND_PLANNED_RUNTIME, do_not_specialize_on_alignment=_EXTEND_PLANNED_RUNTIME)
def _alloc_extend_write_planned_kernel(
    args_address,
    started_address,
    req_to_token_ptr,
    free_pages_ptr,
    free_cap: tl.int64,
    row_stride: tl.int64,
    plan_stride: tl.int64,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # A grid of `plan_stride` programs, at least the block's batch size: programs past it do
    # nothing. The header and the plan (rows of `plan_stride` entries, after the header's
    # EXTEND_ARGS_HEADER entries: a jitted function reads no global) are read at once, none
    # waiting on another. Program 0 writes the call's number to `started`: once it shows,
    # every earlier launch on the stream is done.
    pid = tl.program_id(0)
    args = args_address.to(tl.pointer_type(tl.int64))
    bs = tl.load(args + 0)
    started = started_address.to(tl.pointer_type(tl.int64))
    tl.store(started, tl.load(args + 5), mask=pid == 0)
    _extend_write_request(args + 8, plan_stride, pid, pid < bs, bs, req_to_token_ptr, free_pages_ptr,
                          tl.load(args + 3).to(tl.pointer_type(tl.int64)), tl.load(args + 1), free_cap,
                          tl.load(args + 2), row_stride, tl.load(args + 4), PAGE_SIZE, BLOCK)


_alloc_extend_write_planned_launch = Launcher(_alloc_extend_write_planned_kernel)


def fill_extend_args(block: np.ndarray, stride: int, rows, prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     prefixes, page_size: int, out: torch.Tensor, extend_num_tokens: int, free_start: int,
                     num_free: int, call: int, host_plan: np.ndarray | None = None) -> None:
    """Write the argument block of :func:`alloc_extend_write_planned` (header, then the plan in
    rows of ``stride`` entries, ``stride`` at least the batch size; ``host_plan`` as in
    :func:`alloc_extend_write_triton`) for a batch whose lengths, rows and
    ``extend_num_tokens`` new slots go to ``out`` (at least ``3 * bs + extend_num_tokens`` int64
    on the device). ``block`` must hold ``extend_args_entries(stride)`` entries."""
    block[:6] = (len(rows), free_start, num_free, out.data_ptr(), extend_num_tokens, call)
    plan = block[EXTEND_ARGS_HEADER : extend_args_entries(stride)].reshape(_PLAN_ROWS, stride)
    _write_plan(plan, rows, prefix_lens_cpu, seq_lens_cpu, prefixes, page_size, host_plan)


def fill_extend_args_ahead(block: np.ndarray, words: memoryview, base: int, stride: int, rows: list[int],
                           host_plan: np.ndarray, out_address: int, extend_num_tokens: int, free_start: int,
                           num_free: int, call: int) -> None:
    """:func:`fill_extend_args` of a batch whose plan was built ahead (``host_plan``), into the
    block at ``base`` of ``block`` (``words`` its memoryview): the header word by word, the
    plan in one copy when ``stride`` is the batch size, then the rows. A steady prefill's fill,
    at the least host cost."""
    bs = len(rows)
    words[base + EXTEND_ARG_BS] = bs
    words[base + EXTEND_ARG_FREE_START] = free_start
    words[base + EXTEND_ARG_NUM_FREE] = num_free
    words[base + EXTEND_ARG_OUT] = out_address
    words[base + EXTEND_ARG_OUT_NUMEL] = extend_num_tokens
    words[base + EXTEND_ARG_CALL] = call
    plan = base + EXTEND_ARGS_HEADER
    if stride == bs:
        block[plan : plan + _PLAN_ROWS * bs] = host_plan
    else:
        block[plan : plan + _PLAN_ROWS * stride].reshape(_PLAN_ROWS, stride)[:, :bs] = host_plan.reshape(_PLAN_ROWS, bs)
    row = plan + _PLAN_ROW * stride
    if bs == 1:
        words[row] = rows[0]
    else:
        block[row : row + bs] = rows


def _write_plan(plan: np.ndarray, rows, prefix_lens_cpu, seq_lens_cpu, prefixes, page_size: int,
                host_plan: np.ndarray | None) -> None:
    """The plan of a batch into the first ``bs`` columns of ``plan`` (``_PLAN_ROWS`` rows):
    computed, or ``host_plan`` copied and the rows set."""
    bs = len(rows)
    if host_plan is None:
        _fill_plan(plan, prefix_lens_cpu.numpy(), seq_lens_cpu.numpy(), rows, prefixes, page_size)
    elif bs == 1:
        plan[:, 0] = host_plan
        plan[_PLAN_ROW, 0] = rows[0]
    else:
        plan[:, :bs] = host_plan.reshape(_PLAN_ROWS, bs)
        plan[_PLAN_ROW, :bs] = rows


def alloc_extend_write_planned(args_address: int, started_address: int, req_to_token: torch.Tensor,
                               free_pages: torch.Tensor, page_size: int, grid: int) -> None:
    """``alloc_extend_write_triton`` with every per-call value read from the argument block at
    ``args_address`` (``fill_extend_args`` with ``stride`` = ``grid``; pinned host memory on
    CUDA, any host memory under the interpreter), so that a graph captured once replays any
    batch of at most ``grid`` requests. The call's number goes to the int64 at
    ``started_address`` when the launch starts. Nothing is validated (the allocator's path)."""
    _alloc_extend_write_planned_launch((grid,), args_address, started_address, req_to_token, free_pages,
                                       free_pages.shape[0], req_to_token.stride(0), grid, page_size, _EXTEND_BLOCK)


def extend_args_entries(stride: int) -> int:
    """The int64 entries of an argument block whose plan rows hold ``stride`` requests."""
    return EXTEND_ARGS_HEADER + _PLAN_ROWS * stride


def extend_output_entries(bs: int, extend_num_tokens: int) -> int:
    """The int64 entries an extend fills: lengths and rows, then the new slots."""
    return _DEVICE_ROWS * bs + extend_num_tokens


def extend_output(bs: int, extend_num_tokens: int, device: torch.device) -> torch.Tensor:
    """The device allocation an extend fills (``extend_output_entries``)."""
    return torch.empty(extend_output_entries(bs, extend_num_tokens), dtype=torch.int64, device=device)


def extend_views(buffer: torch.Tensor, bs: int, extend_num_tokens: int) -> ExtendWrite:
    """The views of an extend's output (of at least ``3 * bs + extend_num_tokens`` entries):
    the new slots, rows, prefix and sequence lengths."""
    # One call for every view, where Tensor.split goes through Python; the unsafe variant
    # skips autograd's view records (integer tensors never need them): the same views, sooner.
    rest = buffer.shape[0] - extend_output_entries(bs, extend_num_tokens)
    if rest:
        pre_d, seq_d, rows_d, out, _ = buffer.unsafe_split_with_sizes((bs, bs, bs, extend_num_tokens, rest))
    else:
        pre_d, seq_d, rows_d, out = buffer.unsafe_split_with_sizes((bs, bs, bs, extend_num_tokens))
    return ExtendWrite(out, rows_d, pre_d, seq_d)


def _check_alloc_extend_write(req_to_token, rows, prefix_lens_cpu, seq_lens_cpu, prefixes, free_pages,
                              page_size, free_start, num_free, extend_num_tokens, kept_prefix=None):
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, ndim=2)
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token rows must be contiguous (stride(1) == 1)")
    device = req_to_token.device
    check_tensor("prefix_lens_cpu", prefix_lens_cpu, device=torch.device("cpu"), contiguous=True)
    bs = prefix_lens_cpu.shape[0]
    check_tensor("seq_lens_cpu", seq_lens_cpu, device=torch.device("cpu"), length=bs, contiguous=True)
    if len(rows) != bs or len(prefixes) != bs:
        raise ValueError(f"rows ({len(rows)}) and prefixes ({len(prefixes)}) must have one entry per request ({bs})")
    _check_free_ring(free_pages, free_start, num_free, device)
    check_page_size(page_size)
    for i, (prefix, n) in enumerate(zip(prefixes, prefix_lens_cpu.tolist())):
        check_tensor(f"prefixes[{i}]", prefix, device=device, length=n, contiguous=True,
                     length_of="its prefix length")
    new_tokens = seq_lens_cpu - prefix_lens_cpu
    if bs and int(new_tokens.min()) < 0:
        i = int(new_tokens.argmin())
        raise ValueError(f"request {i}: seq_len {int(seq_lens_cpu[i])} < prefix_len {int(prefix_lens_cpu[i])}")
    if extend_num_tokens is not None and extend_num_tokens != int(new_tokens.sum()):
        raise ValueError(f"extend_num_tokens {extend_num_tokens} != sum(seq_lens - prefix_lens) {int(new_tokens.sum())}")
    if kept_prefix is not None:
        _check_kept_prefix(req_to_token, rows, prefix_lens_cpu.tolist(), prefixes, kept_prefix)


def _check_kept_prefix(req_to_token, rows, prefix_lens: list[int], prefixes, kept_prefix) -> None:
    """Each row holds the first ``kept_prefix[i]`` slots of its prefix already."""
    if len(kept_prefix) != len(prefix_lens):
        raise ValueError(f"kept_prefix ({len(kept_prefix)}) must have one entry per request ({len(prefix_lens)})")
    for i, (row, n, prefix, k) in enumerate(zip(rows, prefix_lens, prefixes, kept_prefix)):
        if not 0 <= k <= n:
            raise ValueError(f"request {i}: kept_prefix {k} outside its prefix [0, {n}]")
        if k and not torch.equal(req_to_token[int(row), :k].to(torch.int64), prefix[:k].to(req_to_token.device)):
            raise ValueError(f"request {i}: row {int(row)} does not hold the first {k} slots of its prefix"
                             f" (kept_prefix says it does)")


def _fill_plan(plan: np.ndarray, pre: np.ndarray, seq: np.ndarray, rows, prefixes, page_size: int) -> None:
    """The six plan rows of ``_PLAN_*`` (the first ``bs`` columns of ``plan``, six rows):
    lengths, rows, prefix addresses (0 for an empty prefix, never read), and the exclusive
    prefix sums of new tokens and new pages."""
    bs = pre.shape[0]
    if bs == 1:  # one request: six host values, no array arithmetic
        p = int(pre[0])
        plan[:, 0] = (p, int(seq[0]), rows[0], prefixes[0].data_ptr() if p else 0, 0, 0)
        return
    plan[_PLAN_PRE, :bs], plan[_PLAN_SEQ, :bs], plan[_PLAN_ROW, :bs] = pre, seq, rows
    if np.count_nonzero(pre):
        plan[_PLAN_PREFIX_PTR, :bs] = [p.data_ptr() for p in prefixes]
    else:
        plan[_PLAN_PREFIX_PTR, :bs] = 0
    out_start = plan[_PLAN_OUT_START, :bs]
    out_start[0] = 0
    np.cumsum((seq - pre)[:-1], out=out_start[1:])
    page_start = plan[_PLAN_PAGE_START, :bs]
    if page_size == 1:
        page_start[:] = out_start
    else:
        page_start[0] = 0
        pages = (seq + page_size - 1) // page_size - (pre + page_size - 1) // page_size
        np.cumsum(pages[:-1], out=page_start[1:])


def extend_host_plan(prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, prefixes, page_size: int) -> np.ndarray:
    """The plan ``alloc_extend_write_triton`` reads (``_PLAN_*``: lengths, prefix addresses,
    token and page offsets), built when a batch is planned rather than on its memory path;
    the request rows (entries ``2 bs .. 3 bs``) are left 0, as the rows of new requests are
    only known when they are taken. Pass it as ``host_plan``; it stays valid while the
    ``prefixes`` it points at live and are not moved."""
    bs = prefix_lens_cpu.shape[0]
    plan = np.zeros(_PLAN_ROWS * bs, dtype=np.int64)
    if bs:
        _fill_plan(plan.reshape(_PLAN_ROWS, bs), prefix_lens_cpu.numpy(), seq_lens_cpu.numpy(), [0] * bs, prefixes,
                   page_size)
    return plan


def alloc_extend_write_triton(
    req_to_token: torch.Tensor,
    rows,
    prefix_lens_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    prefixes,
    free_pages: torch.Tensor,
    page_size: int,
    extend_num_tokens: int | None = None,
    validate: bool = True,
    free_start: int = 0,
    num_free: int | None = None,
    host_plan: np.ndarray | None = None,
    kept_prefix: list[int] | None = None,
) -> ExtendWrite:
    """Triton ``alloc_extend_write``: one device allocation and one launch, which reads its
    plan from host memory (``PlanArena``); see :func:`alloc_extend_write`. With ``host_plan``
    (``extend_host_plan`` of the same lengths and prefixes) the plan is copied, not computed,
    and only the rows are written into it. ``kept_prefix`` is checked (with ``validate``) and
    otherwise not read: the kernel writes every prefix, the same values."""
    cap = free_pages.shape[0]
    num_free = cap if num_free is None else num_free
    if validate:
        _check_alloc_extend_write(req_to_token, rows, prefix_lens_cpu, seq_lens_cpu, prefixes, free_pages,
                                  page_size, free_start, num_free, extend_num_tokens, kept_prefix)
        check_triton_device(req_to_token.device, _alloc_extend_write_kernel)
        if host_plan is not None:
            _check_host_plan(host_plan, prefix_lens_cpu, seq_lens_cpu, prefixes, page_size)
    bs = len(rows)
    if extend_num_tokens is None:
        extend_num_tokens = int(seq_lens_cpu.numpy().sum() - prefix_lens_cpu.numpy().sum())
    # Lengths, rows and new slots share one device allocation, which the kernel fills; it is
    # cut into views after the launch, while the device runs the kernel.
    device = req_to_token.device
    buffer = extend_output(bs, extend_num_tokens, device)
    if bs:
        plan, address = _plan_arena.take(_PLAN_ROWS * bs, device)
        _write_plan(plan.reshape(_PLAN_ROWS, bs), rows, prefix_lens_cpu, seq_lens_cpu, prefixes, page_size, host_plan)
        _alloc_extend_write_launch(
            (bs,), address, req_to_token, free_pages, buffer, bs, free_start, cap, num_free, req_to_token.stride(0),
            extend_num_tokens, page_size, _EXTEND_BLOCK,
        )
    return extend_views(buffer, bs, extend_num_tokens)


def _check_host_plan(host_plan, prefix_lens_cpu, seq_lens_cpu, prefixes, page_size) -> None:
    expected = extend_host_plan(prefix_lens_cpu, seq_lens_cpu, prefixes, page_size)
    bs = prefix_lens_cpu.shape[0]
    got = np.array(host_plan, dtype=np.int64, copy=True)
    if got.shape != expected.shape:
        raise ValueError(f"host_plan has {got.shape[0]} entries, the batch's plan {expected.shape[0]}")
    got[2 * bs : 3 * bs] = 0
    if not np.array_equal(got, expected):
        raise ValueError("host_plan is not the plan of these lengths and prefixes (extend_host_plan)")


def alloc_extend_write_torch(
    req_to_token: torch.Tensor,
    rows,
    prefix_lens_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    prefixes,
    free_pages: torch.Tensor,
    page_size: int,
    extend_num_tokens: int | None = None,
    validate: bool = True,
    free_start: int = 0,
    num_free: int | None = None,
    host_plan: np.ndarray | None = None,
    kept_prefix: list[int] | None = None,
) -> ExtendWrite:
    """Torch reference of ``alloc_extend_write`` (``host_plan`` is not read): the new slots (``_extend_slots_torch``), then
    the rows (``_write_rows_torch``). On a CPU the first ``kept_prefix[i]`` prefix slots of
    request ``i`` are not written: its row holds them already."""
    num_free = free_pages.shape[0] if num_free is None else num_free
    if validate:
        _check_alloc_extend_write(req_to_token, rows, prefix_lens_cpu, seq_lens_cpu, prefixes, free_pages,
                                  page_size, free_start, num_free, extend_num_tokens, kept_prefix)
    device = req_to_token.device
    if extend_num_tokens is None:
        extend_num_tokens = int(seq_lens_cpu.sum() - prefix_lens_cpu.sum())
    if device.type == "cpu":
        return _alloc_extend_write_cpu(req_to_token, rows, prefix_lens_cpu, seq_lens_cpu, prefixes, free_pages,
                                       page_size, extend_num_tokens, free_start, num_free, kept_prefix)
    return _alloc_extend_write_device(req_to_token, rows, prefix_lens_cpu, seq_lens_cpu, prefixes, free_pages,
                                      page_size, extend_num_tokens, free_start, num_free)


def _alloc_extend_write_device(req_to_token, rows, prefix_lens_cpu, seq_lens_cpu, prefixes, free_pages,
                               page_size: int, extend_num_tokens: int, free_start: int, num_free: int) -> ExtendWrite:
    """``alloc_extend_write_torch`` on any device: the batch's prefixes joined once, for the
    rows and (paged) for the slot before each request's new tokens."""
    device = req_to_token.device
    prefix_lens = prefix_lens_cpu.to(device, non_blocking=True)
    seq_lens = seq_lens_cpu.to(device, non_blocking=True)
    rows_t = torch.as_tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    pre = prefix_lens_cpu.numpy()
    if page_size == 1:
        # No last slot to look up: the prefixes alone, without the paged path's sentinel.
        prefix_flat = prefixes[0] if len(prefixes) == 1 else torch.cat([*prefixes, free_pages[:0]])
        total_prefix = prefix_flat.shape[0]
        out = _flat_slots(free_pages, free_start, extend_num_tokens, num_free)
    else:
        prefix_flat = torch.cat([*prefixes, free_pages.new_full((1,), -1)])
        total_prefix = prefix_flat.shape[0] - 1
        new_pages = int((cdiv(seq_lens_cpu.numpy(), page_size) - cdiv(pre, page_size)).sum())
        head = _ring_slice(free_pages, free_start, min(new_pages, num_free))  # past num_free: page -1
        # last_loc: the slot before each request's new tokens, -1 (the sentinel) without a prefix.
        last_index = torch.from_numpy(np.where(pre > 0, np.cumsum(pre) - 1, total_prefix)).to(device)
        out = _extend_slots_torch(prefix_lens, seq_lens, prefix_flat[last_index], head, page_size,
                                  extend_num_tokens)
    _write_rows_torch(req_to_token, rows_t, prefix_lens, seq_lens, out, prefix_flat[:total_prefix])
    return ExtendWrite(out, rows_t, prefix_lens, seq_lens)


def _flat_slots(free_pages, free_start: int, n: int, num_free: int) -> torch.Tensor:
    """Page size 1: the next `n` entries of the ring of `num_free` from `free_start` (a copy),
    slot -1 past `num_free`."""
    head = _ring_slice(free_pages, free_start, min(n, num_free))
    missing = n - head.shape[0]
    return torch.cat([head, head.new_full((missing,), -1)]) if missing else head.clone()


def _alloc_extend_write_cpu(req_to_token, rows, prefix_lens_cpu, seq_lens_cpu, prefixes, free_pages,
                            page_size: int, extend_num_tokens: int, free_start: int, num_free: int,
                            kept_prefix: list[int] | None = None) -> ExtendWrite:
    """``alloc_extend_write_torch`` on a CPU: the same slots and rows, each row written from
    its request's own prefix (the batch's prefixes are never joined into one copy; the
    ``kept_prefix`` slots a row holds already not at all), every copy a numpy slice."""
    pre, seq = prefix_lens_cpu.tolist(), seq_lens_cpu.tolist()
    if page_size == 1:
        out = _flat_slots(free_pages, free_start, extend_num_tokens, num_free)
    else:
        # last_loc: the slot before each request's new tokens, -1 without a prefix.
        last = [int(p.numpy()[n - 1]) if n else -1 for p, n in zip(prefixes, pre)]
        new_pages = sum(cdiv(s, page_size) - cdiv(p, page_size) for p, s in zip(pre, seq))
        head = _ring_slice(free_pages, free_start, min(new_pages, num_free))  # past num_free: page -1
        out = _extend_slots_torch(prefix_lens_cpu, seq_lens_cpu, last, head, page_size, extend_num_tokens)
    table, new = req_to_token.numpy(), out.numpy()
    kept = kept_prefix if kept_prefix is not None else [0] * len(pre)
    off = 0
    for row, p, s, prefix, k in zip(rows.tolist() if isinstance(rows, torch.Tensor) else rows, pre, seq, prefixes,
                                    kept):
        dest = table[row]
        if p > k:
            dest[k:p] = prefix.numpy()[k:p]
        dest[p:s] = new[off : off + s - p]
        off += s - p
    return ExtendWrite(out, torch.as_tensor(rows, dtype=torch.int64), prefix_lens_cpu, seq_lens_cpu)


def alloc_extend_write(
    req_to_token: torch.Tensor,
    rows,
    prefix_lens_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    prefixes,
    free_pages: torch.Tensor,
    page_size: int,
    backend: str = "triton",
    extend_num_tokens: int | None = None,
    validate: bool = True,
    free_start: int = 0,
    num_free: int | None = None,
    host_plan: np.ndarray | None = None,
    kept_prefix: list[int] | None = None,
) -> ExtendWrite:
    """Fused extend memory step: new slots for every request and its whole ``req_to_token`` row.

    Request ``i`` uses row ``rows[i]``; its prefix slots ``prefixes[i]`` (int64, length
    ``prefix_lens_cpu[i]``, on the device) go to columns ``[0, pre_i)`` and its new slots,
    laid out as the module docstring draws (``last_loc = prefixes[i][-1]``, -1 without a
    prefix), to columns ``[pre_i, seq_i)`` and to ``out_cache_loc`` in batch order. Lengths
    and rows are host values (CPU int64 tensors, a list of ints), so every offset is computed
    on the host and the triton backend makes one copy and one launch, with no sync.
    The free list is read, not advanced: ``num_free`` entries (default: all) of ``free_pages``
    read as a ring from ``free_start``, as in :func:`alloc_decode_write`; it must hold the
    batch's new pages (entries past ``num_free`` read as page -1).
    ``extend_num_tokens`` (``sum(seq - pre)``) may be passed when the caller has it, and
    ``host_plan`` (``extend_host_plan`` of the same lengths and prefixes, built when the batch
    was planned), which the triton backend then copies instead of computing.
    ``validate=False`` skips every input check, the per-request ones included: for callers
    whose inputs are right by construction (the allocator, outside its debug mode).
    ``kept_prefix[i]`` (optional) says row ``rows[i]`` holds the first ``kept_prefix[i]``
    slots of its prefix already (checked with ``validate``); the torch backend on a CPU does
    not write them again, the others write them (the same values).
    Raises ``ValueError`` on bad input.
    """
    check_backend(backend)
    fn = alloc_extend_write_triton if backend == "triton" else alloc_extend_write_torch
    return fn(req_to_token, rows, prefix_lens_cpu, seq_lens_cpu, prefixes, free_pages, page_size, extend_num_tokens,
              validate, free_start, num_free, host_plan, kept_prefix)


# ----------------------------------------------------------------------------- free of whole rows

# The most pages one sorted free of rows takes (one program sorts them all; on an H200 a
# 1,024-lane sort ran 20 µs on the device, a 4,096-lane one 106 µs); more go through torch.
FREE_ROWS_SORT_MAX = 1024
_FREE_ROWS_BLOCK = 1024

_FREE_ROWS_RUNTIME = ["table_ptr", "rows_ptr", "free_pages_ptr", "row0", "row_stride", "pages_per_row", "n",
                      "dest_start", "free_cap"]


@triton.jit(do_not_specialize=_FREE_ROWS_RUNTIME, do_not_specialize_on_alignment=_FREE_ROWS_RUNTIME)
def _free_rows_kernel(
    table_ptr,
    rows_ptr,
    free_pages_ptr,
    row0: tl.int64,
    row_stride: tl.int64,
    pages_per_row: tl.int64,
    n: tl.int64,
    dest_start: tl.int64,
    free_cap: tl.int64,
    PAGE_SIZE: tl.constexpr,
    ROW_INDEX: tl.constexpr,
    SORT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Entry k is page k % pages_per_row of request k // pages_per_row: the slot at column
    # (k % pages_per_row) * PAGE_SIZE of its row names its page.
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = k < n
    r = k // pages_per_row
    if ROW_INDEX:
        row = tl.load(rows_ptr + r, mask=mask, other=0)
    else:
        row = row0 + r
    slot = tl.load(table_ptr + row * row_stride + (k % pages_per_row) * PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    page = slot // PAGE_SIZE
    if SORT:  # one program holds every page; the masked lanes sort last and are not stored
        page = tl.sort(tl.where(mask, page, 9223372036854775807))
    tl.store(free_pages_ptr + _ring(dest_start + k, free_cap), page, mask=mask)


_free_rows_launch = Launcher(_free_rows_kernel)


def free_rows_triton(req_to_token: torch.Tensor, row0: int, row_index: torch.Tensor | None, num_rows: int,
                     length: int, free_pages: torch.Tensor, dest_start: int, page_size: int, sort: bool) -> int:
    """Write the pages of columns ``[0, length)`` of ``num_rows`` request rows into the free
    list ``free_pages`` (a ring) from ``dest_start``, in one launch; returns the pages written.

    The rows are ``row0 .. row0 + num_rows - 1``, or ``row_index`` (int64, on the device) when
    given. Column ``j * page_size`` names page ``j`` of a row (its slots sit at offset
    ``t % page_size``), so every page is written once: row after row, or (``sort``) sorted
    ascending, as a sort of the distinct pages gives; ``sort`` takes at most
    ``FREE_ROWS_SORT_MAX`` pages. The caller checked that the ring has room and the rows hold
    their own slots; nothing is validated here (the allocator's internal path)."""
    pages_per_row = (length + page_size - 1) // page_size
    n = num_rows * pages_per_row
    if n == 0:
        return 0
    if sort:
        block, grid = max(next_power_of_2(n), 16), 1
    else:
        block, grid = _FREE_ROWS_BLOCK, cdiv(n, _FREE_ROWS_BLOCK)
    rows = free_pages if row_index is None else row_index  # any int64 tensor when unused
    _free_rows_launch((grid,), req_to_token, rows, free_pages, row0, req_to_token.stride(0), pages_per_row, n,
                      dest_start, free_pages.shape[0], page_size, row_index is not None, sort, block)
    return n


# ----------------------------------------------------------------------------- free of whole rows, from host memory

# The arguments of a free of rows as one block of int64 in host memory, which the kernel reads
# (so a CUDA graph of the launch can be replayed for any rows): the first row, pages per row,
# pages in all, where they go in the free list, the call's number, and the number the kernel
# writes back once it has read the block (the host reuses a block only after that).
FREE_ARG_ROW0, FREE_ARG_PER_ROW, FREE_ARG_N, FREE_ARG_DEST, FREE_ARG_CALL, FREE_ARG_DONE = range(6)
FREE_ARGS = 8  # entries per block
# The most pages a free from host memory takes unsorted: one program loops over them.
FREE_ROWS_LOOP_MAX = 16384

_FREE_PLANNED_RUNTIME = ["args_address", "table_ptr", "free_pages_ptr", "row_stride", "free_cap"]


@triton.jit(do_not_specialize=_FREE_PLANNED_RUNTIME, do_not_specialize_on_alignment=_FREE_PLANNED_RUNTIME)
def _free_rows_planned_kernel(
    args_address,
    table_ptr,
    free_pages_ptr,
    row_stride: tl.int64,
    free_cap: tl.int64,
    PAGE_SIZE: tl.constexpr,
    SORT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program: the pages of consecutive rows from `row0`, as `_free_rows_kernel` writes them.
    args = args_address.to(tl.pointer_type(tl.int64))
    row0 = tl.load(args + 0)
    pages_per_row = tl.load(args + 1)
    n = tl.load(args + 2)
    dest_start = tl.load(args + 3)
    call = tl.load(args + 4)
    for start in range(0, n, BLOCK):  # SORT: n <= BLOCK, one pass
        k = start + tl.arange(0, BLOCK)
        mask = k < n
        row = row0 + k // pages_per_row
        slot = tl.load(table_ptr + row * row_stride + (k % pages_per_row) * PAGE_SIZE, mask=mask, other=0)
        page = slot.to(tl.int64) // PAGE_SIZE
        if SORT:
            page = tl.sort(tl.where(mask, page, 9223372036854775807))
        tl.store(free_pages_ptr + _ring(dest_start + k, free_cap), page, mask=mask)
    tl.store(args + 5, call)  # written from a value read above: after the block was read


_free_rows_planned_launch = Launcher(_free_rows_planned_kernel)


def free_rows_block(n: int, page_size: int) -> int | None:
    """The block size of :func:`free_rows_planned` for ``n`` pages (sorted above page size 1),
    or None when one program does not take them (more than ``FREE_ROWS_SORT_MAX`` sorted,
    ``FREE_ROWS_LOOP_MAX`` unsorted)."""
    if page_size > 1:
        return max(next_power_of_2(n), 16) if n <= FREE_ROWS_SORT_MAX else None
    return _FREE_ROWS_BLOCK if n <= FREE_ROWS_LOOP_MAX else None


def free_rows_planned(args_address: int, req_to_token: torch.Tensor, free_pages: torch.Tensor, page_size: int,
                      block: int) -> None:
    """The free of consecutive rows of :func:`free_rows_triton`, its arguments read from the
    ``FREE_ARGS`` int64 at ``args_address`` (pinned host memory on CUDA, any host memory under
    the interpreter), which it marks read (``FREE_ARG_DONE`` = ``FREE_ARG_CALL``); one program,
    ``block`` from :func:`free_rows_block`. Nothing is validated (the allocator's path)."""
    _free_rows_planned_launch((1,), args_address, req_to_token, free_pages, req_to_token.stride(0),
                              free_pages.shape[0], page_size, page_size > 1, block)
