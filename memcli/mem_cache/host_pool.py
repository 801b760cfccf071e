"""The host tier of the hierarchical cache: slots in host memory that hold copies of KV pages.

`HostKVPool` mirrors SGLang 0.5.5's `HostKVCache` (mem_cache/memory_pool_host.py):

    slots [0, size)          host slot ids; no padding slot (the device pool's slot 0 is)
    free list                allocation takes its head, a free appends at its tail
    size                     a multiple of page_size; alloc(n) needs n % page_size == 0

Host slots are token indices, as on the device; a page of the host pool is `page_size`
consecutive slots starting at a multiple of `page_size`, because every allocation takes
whole pages from a free list that only ever holds whole pages.

Materialized (`materialized=True`) the pool also holds K and V of every slot, page-first
(`[size, num_layers, heads, head_dim]`: a slot's K of every layer is one contiguous run, as
SGLang's `page_first` host layout), in pinned memory when a CUDA device is present.
`backup_from_device` gathers device slots (one `index_select` on the device, layer-first to
page-first there) and copies each run of consecutive host slots with one non-blocking copy;
`load_to_device` copies the runs into a device staging buffer and scatters it into the device
slots with one `index_copy_`. A batch's backup usually lands in one run (fresh host pages are
consecutive), so it costs one gather and one device-to-host copy per K and V. Indices-only,
the pool keeps the slot bookkeeping alone (replays of large pools on a CPU).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from memcli.check_result import CheckResult, IntegrityReport
from memcli.mem_cache.pools import TORCH_DTYPES


def runs(host_indices: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of consecutive host slots: (first slot, length, position in `host_indices`)."""
    idx = host_indices.detach().reshape(-1).cpu().numpy()
    if not len(idx):
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(idx)]])
    return [(int(idx[a]), int(b - a), int(a)) for a, b in zip(starts, ends)]


MAX_PAIRED_RUNS = 64  # above this many runs, one gather (or scatter) on the device is cheaper


def _paired_runs(device_indices: torch.Tensor, host_indices: torch.Tensor) -> Optional[list[tuple[int, int, int]]]:
    """Runs consecutive on both sides: (first device slot, first host slot, length); None when
    there are more than `MAX_PAIRED_RUNS`."""
    dev = device_indices.detach().reshape(-1).cpu().numpy()
    host = host_indices.detach().reshape(-1).cpu().numpy()
    if not len(dev):
        return []
    breaks = np.flatnonzero((np.diff(dev) != 1) | (np.diff(host) != 1)) + 1
    if len(breaks) >= MAX_PAIRED_RUNS:
        return None
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(dev)]])
    return [(int(dev[a]), int(host[a]), int(b - a)) for a, b in zip(starts, ends)]


def _to(tensor: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.to(device, non_blocking=non_blocking)


class HostKVPool:
    """`size` host slots in pages of `page_size`; see the module docstring."""

    def __init__(self, size: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: str, materialized: bool = False, pin_memory: bool = False):
        if page_size < 1 or size < page_size or size % page_size:
            raise ValueError(f"host pool of {size} slots: must be a positive multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = TORCH_DTYPES[dtype]
        self.materialized = materialized
        self.pinned = False
        if materialized:
            shape = (size, num_layers, num_kv_heads, head_dim)
            pin = pin_memory and torch.cuda.is_available()
            # Never read before a backup writes it: no need to spend seconds zeroing gigabytes.
            self.k_buffer = torch.empty(shape, dtype=self.dtype, pin_memory=pin)
            self.v_buffer = torch.empty(shape, dtype=self.dtype, pin_memory=pin)
            self.pinned = pin
        else:
            self.k_buffer = self.v_buffer = None
        self._ring = np.empty(size, dtype=np.int64)
        self.clear()

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * itemsize

    # -- the free list (a ring: head = next to hand out, count = free slots) -------------

    def clear(self) -> None:
        """Every slot free again, in order 0, 1, ..., size - 1."""
        self._ring[:] = np.arange(self.size, dtype=np.int64)
        self._head = 0
        self._free = self.size

    def available_size(self) -> int:
        """Free host slots (tokens)."""
        return self._free

    def used_size(self) -> int:
        return self.size - self._free

    def alloc(self, need: int) -> Optional[torch.Tensor]:
        """The first `need` free slots (int64, CPU), or None when fewer are free.

        Raises ValueError when `need` is not a whole number of pages."""
        if need % self.page_size:
            raise ValueError(f"host alloc({need}): not a multiple of page_size {self.page_size}")
        if need > self._free:
            return None
        end = self._head + need
        if end <= self.size:
            out = self._ring[self._head:end].copy()
        else:
            out = np.concatenate([self._ring[self._head:], self._ring[: end - self.size]])
        self._head = end % self.size
        self._free -= need
        return torch.from_numpy(out)

    def free(self, indices: torch.Tensor) -> int:
        """Append `indices` to the free list's tail; returns how many. Raises ValueError when the
        pool would hold more free slots than it has (a double free)."""
        values = indices.detach().reshape(-1).cpu().numpy()
        n = len(values)
        if self._free + n > self.size:
            raise ValueError(f"host free of {n} slots: only {self.size - self._free} are in use (double free)")
        tail = (self._head + self._free) % self.size
        first = min(n, self.size - tail)
        self._ring[tail:tail + first] = values[:first]
        self._ring[: n - first] = values[first:]
        self._free += n
        return n

    def free_slot_ids(self) -> np.ndarray:
        """The free list in allocation order (a copy)."""
        end = self._head + self._free
        if end <= self.size:
            return self._ring[self._head:end].copy()
        return np.concatenate([self._ring[self._head:], self._ring[: end - self.size]])

    # -- copies (materialized pools) -----------------------------------------------------

    def backup_from_device(self, kv_pool, device_indices: torch.Tensor, host_indices: torch.Tensor,
                           non_blocking: bool = True) -> None:
        """Copy K/V of `device_indices` (all layers) into host slots `host_indices`. Non-blocking
        on a GPU: the caller synchronises before reading the host copy."""
        self._need_buffers(kv_pool)
        nb = non_blocking and self.pinned
        pairs = _paired_runs(device_indices, host_indices)
        for dev_buf, host_buf in ((kv_pool.k_buffer, self.k_buffer), (kv_pool.v_buffer, self.v_buffer)):
            if pairs is not None:  # few runs on both sides: copy slices, no gather
                for dev, host, length in pairs:
                    host_buf[host:host + length].copy_(dev_buf[:, dev:dev + length].transpose(0, 1), non_blocking=nb)
                continue
            idx = device_indices.to(dev_buf.device, torch.int64)
            gathered = dev_buf.index_select(1, idx).transpose(0, 1)  # [n, layers, heads, dim]
            for start, length, pos in runs(host_indices):
                host_buf[start:start + length].copy_(gathered[pos:pos + length], non_blocking=nb)

    def load_to_device(self, kv_pool, host_indices: torch.Tensor, device_indices: torch.Tensor,
                       non_blocking: bool = True) -> None:
        """Copy K/V of host slots `host_indices` (all layers) into device slots `device_indices`."""
        self._need_buffers(kv_pool)
        nb = non_blocking and self.pinned
        pairs = _paired_runs(device_indices, host_indices)
        for dev_buf, host_buf in ((kv_pool.k_buffer, self.k_buffer), (kv_pool.v_buffer, self.v_buffer)):
            if pairs is not None:
                for dev, host, length in pairs:
                    dev_buf[:, dev:dev + length].copy_(_to(host_buf[host:host + length], dev_buf.device, nb).transpose(0, 1))
                continue
            idx = device_indices.to(dev_buf.device, torch.int64)
            staging = torch.empty((len(idx), *host_buf.shape[1:]), dtype=host_buf.dtype, device=dev_buf.device)
            for start, length, pos in runs(host_indices):
                staging[pos:pos + length].copy_(host_buf[start:start + length], non_blocking=nb)
            dev_buf.index_copy_(1, idx, staging.transpose(0, 1))

    def _need_buffers(self, kv_pool) -> None:
        if self.k_buffer is None or kv_pool.k_buffer is None:
            raise ValueError("host pool copies need materialized pools on both sides (memory.kv_pool: materialized)")

    # -- checks --------------------------------------------------------------------------

    def check_integrity(self) -> IntegrityReport:
        free = self.free_slot_ids()
        in_range = not len(free) or (free.min() >= 0 and free.max() < self.size)
        twice = int((np.bincount(free, minlength=self.size) > 1).sum()) if in_range and len(free) else 0
        return IntegrityReport("host pool", [
            CheckResult("host free list distinct", not twice and in_range,
                        f"{len(free)} free host slots, {twice} held twice, all in [0, {self.size}): {in_range}"),
        ])
