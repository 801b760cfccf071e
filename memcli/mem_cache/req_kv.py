"""A request's memory state: one record, owned and written by memory alone.

The scheduler reads it (`req.kv`, or the read-only names `Req` mirrors); the memory manager
and the tree caches it calls are its only writers.

Positions of a request row in `req_to_token`:

    [0, last_matched_prefix_len)                 slots owned by the tree (locked via last_node)
    [last_matched_prefix_len, kv_allocated_len)  slots the request owns (freed on finish)
    [0, kv_committed_len)                        positions whose K/V has been computed

Who writes which field, all inside `memcli.mem_cache`:

    MemoryManager           req_pool_idx, kv_allocated_len, kv_committed_len (its extend,
                            decode, commit and release verbs), the host-tier load-back fields,
                            the match (prefix_indices, last_node, last_matched_prefix_len)
    tree cache              prefix_indices, last_node, last_matched_prefix_len
      `cache_unfinished_req`
    tree cache              kv_freed
      `cache_finished_req`
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class ReqKV:
    """What memory holds for one request: its row, its prefix and lock, its KV lengths."""

    __slots__ = ("device", "req_pool_idx", "prefix_indices", "last_node", "last_matched_prefix_len",
                 "last_host_node", "host_hit_length", "host_loaded_len", "host_skipped_len",
                 "kv_allocated_len", "kv_committed_len", "kv_freed", "cache_inserted_len", "prefix_store")

    def __init__(self, device: torch.device):
        self.device = device
        self.host_loaded_len = 0  # tokens loaded back from the host tier before the first admission
        self.host_skipped_len = 0  # this round's host hit that was not loaded (threshold, quota, room)
        self.reset()

    def reset(self) -> None:
        """Back to holding nothing (a new or retracted request); the host-tier tallies are kept."""
        self.req_pool_idx: Optional[int] = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64, device=self.device)
        self.last_node: Any = None
        self.last_matched_prefix_len = 0
        # Host tier: the match's host-only part.
        self.last_host_node: Any = None
        self.host_hit_length = 0
        self.kv_allocated_len = 0
        self.kv_committed_len = 0
        self.kv_freed = False
        # The row's tokens already inserted into the tree (0.5.23's insert counts a hit only past it).
        self.cache_inserted_len = 0
        # Where `prefix_indices` came from when a checkpoint read it off the request's row: see
        # `PrefixStore` (None: from a match, a load-back or nothing).
        self.prefix_store: Optional[PrefixStore] = None

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_indices)

    @property
    def owned_len(self) -> int:
        """Slots of its row the request owns (not the tree's): freed on release."""
        return self.kv_allocated_len - self.last_matched_prefix_len

    def prefix_in_row(self) -> int:
        """How many leading slots of `prefix_indices` the request's row holds already: all of
        them when a checkpoint read the prefix off this very row, which the request kept
        since (an extend need not write them again); else 0."""
        store = self.prefix_store
        if store is not None and store.view is self.prefix_indices and store.row == self.req_pool_idx:
            return self.prefix_indices.shape[0]
        return 0

    def __repr__(self) -> str:
        return (f"ReqKV(row={self.req_pool_idx}, prefix={self.prefix_len}, allocated={self.kv_allocated_len},"
                f" committed={self.kv_committed_len}, freed={self.kv_freed})")


class PrefixStore:
    """The int64 buffer a request's checkpoints read its prefix into, on a CPU.

    A checkpoint's prefix is the request's row up to the checkpoint, as a new int64 tensor
    (SGLang's `prefix_indices`). A chunked request takes one per chunk, each longer than the
    last and each starting with the one before it: copied whole, a prompt of n chunks costs
    n(n+1)/2 chunks of copying. The store keeps one buffer per request instead: `view` is the
    prefix handed out last (`buffer[:len(view)]`), and the next checkpoint, finding the row's
    first `len(view)` slots unchanged, casts only the row's new part into the buffer past
    it. A prefix handed out is never written again (later writes start past the longest
    one), so each stays a copy. `row` is the request row the prefix was read from."""

    __slots__ = ("buffer", "host", "view", "row")

    def __init__(self, capacity: int, row: int):
        self.buffer = torch.empty(capacity, dtype=torch.int64)
        self.host = self.buffer.numpy()
        self.view = self.buffer[:0]
        self.row = row

    def read(self, row_slots, start: int, end: int, row: int) -> torch.Tensor:
        """`row_slots[:end]` as the new prefix, casting `row_slots[start:end]` (the slots
        before `start` are `view`'s already); returns the new view."""
        self.host[start:end] = row_slots[start:end]
        self.view, self.row = self.buffer[:end], row
        return self.view
