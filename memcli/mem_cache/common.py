"""The only allocation entry points of the stack.

The scheduler never calls an allocator or writes `req_to_token` itself; it calls these
functions with a batch that carries `req_to_token_pool`, `token_to_kv_pool_allocator` and
`tree_cache`.

Extend (prefill) of request i, in its `req_to_token` row:

    [0, prefix_len)          prefix slots (`req.prefix_indices`, from the tree or earlier chunks)
    [prefix_len, seq_len)    new slots, out_cache_loc[off_i : off_i + extend_len_i]

Decode: one new slot per request, written at column `seq_len` (the old length); the caller
increments `seq_lens` afterwards.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from memcli import kernels
from memcli.errors import IntegrityError, OutOfMemoryError, RequestSlotsExhausted
from memcli.mem_cache.allocator import cdiv


class PageSizeMismatch(IntegrityError):
    """The allocator and the tree cache disagree about the page size."""


class ExtendAllocation(NamedTuple):
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    req_pool_indices_list: list[int]


def assert_same_page_size(allocator, tree_cache) -> None:
    if allocator.page_size != tree_cache.page_size:
        raise PageSizeMismatch(
            f"page size mismatch: allocator {allocator.page_size}, tree cache {tree_cache.page_size};"
            " every component must take memory.page_size"
        )


def decode_pages_needed(page_size: int, seq_lens_cpu: torch.Tensor) -> int:
    """Pages the next decode step opens: requests whose new position starts a page.

    `seq_lens_cpu` are the lengths before the step. Counted with numpy on the CPU twin: no
    device work and no host sync.
    """
    if page_size == 1:
        return int(seq_lens_cpu.numel())
    return int(np.count_nonzero(seq_lens_cpu.numpy() % page_size == 0))


def decode_tokens_needed(allocator, seq_lens_cpu: torch.Tensor) -> int:
    """Free tokens the next decode step takes; `seq_lens_cpu` are the lengths before it."""
    return decode_pages_needed(allocator.page_size, seq_lens_cpu) * allocator.page_size


def evict_if_needed(tree_cache, allocator, need_tokens: int) -> int:
    """Evict only the shortfall, and only when `available_size()` is short. Returns tokens freed."""
    shortfall = need_tokens - allocator.available_size()
    if shortfall <= 0:
        return 0
    return tree_cache.evict(shortfall)


def out_of_memory(what: str, tree_cache, allocator, need_tokens: int) -> OutOfMemoryError:
    return OutOfMemoryError(what, need_tokens, allocator.available_size(), tree_cache.evictable_size(),
                            tree_cache.protected_size())


def alloc_req_slots(req_to_token_pool, num_reqs: int) -> list[int]:
    rows = req_to_token_pool.alloc(num_reqs)
    if rows is None:
        raise RequestSlotsExhausted(
            f"request slots exhausted: need {num_reqs} rows, {req_to_token_pool.available_size()} of"
            f" {req_to_token_pool.size} free; raise memory.max_running_requests"
        )
    return rows


def alloc_for_extend(batch) -> ExtendAllocation:
    """Request rows, then eviction of the shortfall, then KV slots, then `write_cache_indices`.

    Reads the fields `prepare_for_extend` set: `batch.req_rows` (row per request, None for
    a request without one), `batch.prefix_tensors` (each request's `prefix_indices`),
    `batch.prefix_lens_cpu`, `batch.seq_lens`, `batch.seq_lens_cpu`, `batch.extend_num_tokens`.
    Every offset is computed on the host from the CPU lengths and reaches the device in one
    copy (`ExtendPlan`), so the device sees a handful of launches and no sync.
    On failure raises `OutOfMemoryError` and returns the rows it took.
    """
    allocator, tree_cache, pool = batch.token_to_kv_pool_allocator, batch.tree_cache, batch.req_to_token_pool
    assert_same_page_size(allocator, tree_cache)
    rows, new_rows = _rows_for(pool, batch.req_rows)
    plan = ExtendPlan(batch.prefix_lens_cpu, batch.seq_lens_cpu, rows, allocator.page_size)
    need = plan.num_pages * allocator.page_size
    if need > allocator.available_size():
        evict_if_needed(tree_cache, allocator, need)
    meta = plan.to_device(pool.device)
    if allocator.page_size == 1:
        prefix_flat = torch.cat(batch.prefix_tensors) if plan.total_prefix else _EMPTY.get(pool.device)
        out_cache_loc = allocator.alloc(batch.extend_num_tokens)
    else:
        # A trailing -1 lets requests without a prefix read last_loc = -1 in the same gather.
        prefix_ext = torch.cat([*batch.prefix_tensors, _MINUS_ONE.get(pool.device)])
        prefix_flat = prefix_ext[: plan.total_prefix]
        out_cache_loc = allocator.alloc_extend(meta.prefix_lens, batch.prefix_lens_cpu, batch.seq_lens,
                                               batch.seq_lens_cpu, prefix_ext[meta.last_index],
                                               batch.extend_num_tokens, running_sums=meta.alloc_sums,
                                               num_pages=plan.num_pages)
    if out_cache_loc is None:
        if new_rows:
            pool.free(new_rows)
        raise out_of_memory("prefill", tree_cache, allocator, need)
    kernels.write_cache_indices(pool.req_to_token, meta.rows, meta.prefix_lens, batch.seq_lens,
                                out_cache_loc, prefix_flat, backend=allocator.backend,
                                running_sums=meta.write_sums)
    return ExtendAllocation(out_cache_loc, meta.rows, rows)


class ExtendMeta(NamedTuple):
    """Views of the one device copy of an `ExtendPlan`."""

    prefix_lens: torch.Tensor
    alloc_sums: torch.Tensor  # [4, bs]: inclusive sums of seq, pre, cdiv(seq), cdiv(pre)
    write_sums: torch.Tensor  # [2, bs]: inclusive sums of pre, seq
    last_index: torch.Tensor  # index of each request's last prefix slot (or of the -1 sentinel)
    rows: torch.Tensor


class ExtendPlan:
    """Host-side offsets of an extend batch, from the CPU lengths (numpy; no device work)."""

    def __init__(self, prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, rows: list[int],
                 page_size: int):
        pre, seq = prefix_lens_cpu.numpy(), seq_lens_cpu.numpy()
        sums = np.cumsum(np.stack((seq, pre, cdiv(seq, page_size), cdiv(pre, page_size))), axis=1)
        self.total_prefix = int(sums[1, -1]) if len(pre) else 0
        # New pages (new tokens when page_size is 1): exact, not one page per request.
        self.num_pages = int(sums[2, -1] - sums[3, -1]) if len(pre) else 0
        last_index = np.where(pre > 0, sums[1] - 1, self.total_prefix)
        # Row order: pre | alloc sums (4) | write sums (2) | last_index | rows.
        self.packed = np.concatenate((pre[None], sums, sums[1::-1], last_index[None],
                                      np.asarray(rows, dtype=np.int64)[None]))

    def to_device(self, device: torch.device) -> ExtendMeta:
        meta = torch.from_numpy(self.packed).to(device, non_blocking=True)
        return ExtendMeta(meta[0], meta[1:5], meta[5:7], meta[7], meta[8])


def _rows_for(pool, req_rows: list) -> tuple[list[int], list[int]]:
    """Every request's row, taking new rows for those without one. Returns (rows, new rows)."""
    if None not in req_rows:
        return req_rows, []
    missing = [i for i, row in enumerate(req_rows) if row is None]
    new_rows = alloc_req_slots(pool, len(missing))
    if len(missing) == len(req_rows):
        return new_rows, new_rows
    rows = list(req_rows)
    for i, row in zip(missing, new_rows):
        rows[i] = row
    return rows, new_rows


class _EmptyIndices:
    """One cached small int64 tensor per device: empty, or `[fill]`."""

    def __init__(self, fill: int | None = None):
        self.fill = fill
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        cached = self._by_device.get(device)
        if cached is None:
            values = [] if self.fill is None else [self.fill]
            cached = self._by_device[device] = torch.tensor(values, dtype=torch.int64, device=device)
        return cached


_EMPTY = _EmptyIndices()
_MINUS_ONE = _EmptyIndices(fill=-1)


def alloc_for_decode(batch, token_per_req: int = 1) -> torch.Tensor:
    """One slot per request written at column `batch.seq_lens` (the old lengths).

    Evicts the exact shortfall first. The caller increments `seq_lens` afterwards.
    """
    if token_per_req != 1:
        raise ValueError("alloc_for_decode supports one token per request")
    allocator, tree_cache, pool = batch.token_to_kv_pool_allocator, batch.tree_cache, batch.req_to_token_pool
    assert_same_page_size(allocator, tree_cache)
    num_pages = decode_pages_needed(allocator.page_size, batch.seq_lens_cpu)
    need = num_pages * allocator.page_size
    if need > allocator.available_size():
        evict_if_needed(tree_cache, allocator, need)
    out = allocator.alloc_decode_write(batch.seq_lens, batch.seq_lens_cpu, batch.req_pool_indices,
                                       pool.req_to_token, num_pages=num_pages)
    if out is None:
        raise out_of_memory("decode", tree_cache, allocator, need)
    return out


def check_decode_mem(batch, seq_lens_cpu: torch.Tensor | None = None) -> bool:
    """True when the next decode step of these requests fits, after evicting the shortfall."""
    allocator = batch.token_to_kv_pool_allocator
    lens = batch.seq_lens_cpu if seq_lens_cpu is None else seq_lens_cpu
    need = decode_tokens_needed(allocator, lens)
    evict_if_needed(batch.tree_cache, allocator, need)
    return allocator.available_size() >= need


def release_req(tree_cache, req, is_insert: bool = True) -> None:
    """Release everything a finished (or, with is_insert=False, retracted) request holds."""
    tree_cache.cache_finished_req(req, is_insert=is_insert)


def cache_unfinished(tree_cache, req, chunked: bool = False) -> None:
    """Hand the computed prefix to the tree after a prefill or a chunk."""
    tree_cache.cache_unfinished_req(req, chunked=chunked)


def free_group(allocator):
    """Context manager batching the frees of a result-processing loop into one."""
    return _FreeGroup(allocator)


class _FreeGroup:
    def __init__(self, allocator):
        self.allocator = allocator

    def __enter__(self):
        self.allocator.free_group_begin()
        return self

    def __exit__(self, *exc):
        self.allocator.free_group_end()
        return False


def usage(tree_cache, allocator) -> dict[str, int]:
    """Token counts for reports: available, evictable, protected."""
    return {
        "available": allocator.available_size(),
        "evictable": tree_cache.evictable_size(),
        "protected": tree_cache.protected_size(),
    }
