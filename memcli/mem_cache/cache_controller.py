"""Copies between the device pool and the host pool, on a simulated clock.

`CacheController` plays the part of SGLang 0.5.5's `HiCacheController`
(managers/cache_controller.py) for `HiRadixCache`: it allocates host slots for a backup and
device slots for a load-back, and keeps the acknowledgement queues that the cache drains.

    write(device_indices, node_id)   host slots now, the copy starts at once (one transfer)
    load(host_indices, node_id)      device slots now, the copy is queued
    start_loading()                  the queued loads go as one transfer (SGLang merges them
                                     when the prefill batch is built); returns its end time
    finished_writes() / finished_loads()   the node ids of copies done by now, oldest first;
                                     the first copy not yet done stops the scan (FIFO)
    wait_writes()                    block until every write is done (write-back eviction);
                                     the wait is added to `stall_ms`

Time: each direction is one copy engine. A copy of `b` bytes takes `latency_us + b /
bandwidth` and starts when both its issue time (`now()`, in ms) and the end of the previous
copy in its direction have come. With `bandwidth_gbps=inf` and `latency_us=0` every copy is
done the moment it is issued: a synchronous controller, as the differential tests use.

When both pools are materialized the K/V data is really copied (`HostKVPool.backup_from_device`
and `load_to_device`); otherwise only indices move.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch

from memcli.mem_cache.integrity.owners import LOOSE, TREE


class Ack(NamedTuple):
    """One transfer in flight: when it ends, and the nodes it unlocks."""

    end_ms: float
    node_ids: list[int]


class _Op(NamedTuple):
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    node_id: int


@dataclass
class TransferStats:
    """Totals since the controller was built (bytes, copies, copy-engine busy time)."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_copies: int = 0
    h2d_copies: int = 0
    d2h_busy_ms: float = 0.0
    h2d_busy_ms: float = 0.0
    stall_ms: float = 0.0  # time the scheduler waited on write-backs (write_back eviction)
    load_wait_ms: float = 0.0  # time prefill batches waited on load-backs past their compute


class CacheController:
    """Host/device copies for `HiRadixCache`; see the module docstring."""

    def __init__(self, allocator: Any, host_pool: Any, write_policy: str, bytes_per_token: int,
                 bandwidth_gbps: float = math.inf, latency_us: float = 0.0,
                 now: Optional[Callable[[], float]] = None, kv_pool: Any = None):
        if write_policy not in ("write_through", "write_through_selective", "write_back"):
            raise ValueError(f"unknown write policy {write_policy!r}")
        if not bandwidth_gbps > 0 or latency_us < 0:
            raise ValueError(f"bandwidth {bandwidth_gbps} GB/s must be > 0, latency {latency_us} us >= 0")
        self.allocator = allocator
        self.host_pool = host_pool
        self.kv_pool = kv_pool
        self.write_policy = write_policy
        self.bytes_per_token = bytes_per_token
        self.bandwidth_gbps = bandwidth_gbps
        self.latency_us = latency_us
        self.now: Callable[[], float] = now or (lambda: 0.0)
        self.copy_data = bool(kv_pool is not None and host_pool.materialized and kv_pool.k_buffer is not None)
        self.stats = TransferStats()
        self.reset()

    def reset(self) -> None:
        self.load_queue: list[_Op] = []
        self.ack_write_queue: deque[Ack] = deque()
        self.ack_load_queue: deque[Ack] = deque()
        self._d2h_free_ms = 0.0
        self._h2d_free_ms = 0.0
        self._pending_stall = 0.0

    # -- timing ----------------------------------------------------------------------------

    def copy_ms(self, tokens: int) -> float:
        """How long one copy of `tokens` tokens takes on a copy engine."""
        num_bytes = tokens * self.bytes_per_token
        return self.latency_us / 1e3 + num_bytes / (self.bandwidth_gbps * 1e9) * 1e3

    def _schedule(self, tokens: int, d2h: bool) -> float:
        start = max(self.now(), self._d2h_free_ms if d2h else self._h2d_free_ms)
        took = self.copy_ms(tokens)
        end = start + took
        stats = self.stats
        if d2h:
            self._d2h_free_ms = end
            stats.d2h_bytes += tokens * self.bytes_per_token
            stats.d2h_copies += 1
            stats.d2h_busy_ms += took
        else:
            self._h2d_free_ms = end
            stats.h2d_bytes += tokens * self.bytes_per_token
            stats.h2d_copies += 1
            stats.h2d_busy_ms += took
        return end

    # -- device -> host ---------------------------------------------------------------------

    def write(self, device_indices: torch.Tensor, node_id: int) -> Optional[torch.Tensor]:
        """Back `device_indices` up: host slots (None when the host pool is short), copy started."""
        host_indices = self.host_pool.alloc(len(device_indices))
        if host_indices is None:
            return None
        if self.copy_data:
            self.host_pool.backup_from_device(self.kv_pool, device_indices, host_indices)
        end = self._schedule(len(device_indices), d2h=True)
        self.ack_write_queue.append(Ack(end, [node_id]))
        return host_indices

    def finished_writes(self) -> list[int]:
        """Node ids of the writes done by now, oldest first (the scan stops at the first not done)."""
        return self._drain(self.ack_write_queue)

    def wait_writes(self, stall: bool = True) -> list[int]:
        """Every write, done or not: the scheduler waits for the last (added to `stall_ms`
        unless `stall` is False: nobody waits in the simulated time)."""
        ids = []
        now = self.now()
        while self.ack_write_queue:
            ack = self.ack_write_queue.popleft()
            if stall:
                self._pending_stall = max(self._pending_stall, ack.end_ms - now)
            ids.extend(ack.node_ids)
        return ids

    @property
    def pending_stall_ms(self) -> float:
        """The wait for write-backs that `take_stall_ms` would hand over now."""
        return max(self._pending_stall, 0.0)

    def take_stall_ms(self) -> float:
        """The wait for write-backs since the last call (the step that evicted pays it)."""
        stall, self._pending_stall = max(self._pending_stall, 0.0), 0.0
        self.stats.stall_ms += stall
        return stall

    # -- host -> device ---------------------------------------------------------------------

    def load(self, host_indices: torch.Tensor, node_id: int) -> Optional[torch.Tensor]:
        """Device slots for `host_indices` (None when the allocator is short); the copy is queued
        until `start_loading`. The slots belong to the tree at once (ledger: -> TREE)."""
        device_indices = self.allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        ledger = getattr(self.allocator, "ledger", None)
        if ledger is not None:
            ledger.move(device_indices, LOOSE, TREE, "load_back")
        self.load_queue.append(_Op(host_indices, device_indices, node_id))
        return device_indices

    def start_loading(self) -> Optional[float]:
        """Launch the queued loads as one transfer; its end time (ms), or None when none is queued."""
        if not self.load_queue:
            return None
        ops, self.load_queue = self.load_queue, []
        tokens = sum(len(op.host_indices) for op in ops)
        if self.copy_data:
            host = torch.cat([op.host_indices for op in ops])
            device = torch.cat([op.device_indices for op in ops])
            self.host_pool.load_to_device(self.kv_pool, host, device)
        end = self._schedule(tokens, d2h=False)
        self.ack_load_queue.append(Ack(end, [op.node_id for op in ops]))
        return end

    def finished_loads(self) -> list[int]:
        return self._drain(self.ack_load_queue)

    def _drain(self, queue: deque) -> list[int]:
        now, ids = self.now(), []
        while queue and queue[0].end_ms <= now:
            ids.extend(queue.popleft().node_ids)
        return ids

    # -- frees ------------------------------------------------------------------------------

    def evict_device(self, device_indices: torch.Tensor, segment: bool = False) -> int:
        """A backed-up node gives its device slots back (ledger: TREE -> FREE); `segment`: as
        one run in row order (0.5.23's free_segment)."""
        extra = {"segment": True} if segment else {}
        if getattr(self.allocator, "ledger", None) is not None:
            self.allocator.free(device_indices, owner=TREE, op="evict (backed up)", **extra)
        else:
            self.allocator.free(device_indices, **extra)
        return len(device_indices)

    def evict_host(self, host_indices: torch.Tensor) -> int:
        return self.host_pool.free(host_indices)

    def next_end_ms(self) -> Optional[float]:
        """When the oldest copy in flight ends (None when none is)."""
        heads = [queue[0].end_ms for queue in (self.ack_write_queue, self.ack_load_queue) if queue]
        return min(heads) if heads else None

    @property
    def in_flight(self) -> int:
        return len(self.ack_write_queue) + len(self.ack_load_queue) + bool(self.load_queue)
