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
                 "kv_allocated_len", "kv_committed_len", "kv_freed", "cache_inserted_len")

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

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_indices)

    @property
    def owned_len(self) -> int:
        """Slots of its row the request owns (not the tree's): freed on release."""
        return self.kv_allocated_len - self.last_matched_prefix_len

    def __repr__(self) -> str:
        return (f"ReqKV(row={self.req_pool_idx}, prefix={self.prefix_len}, allocated={self.kv_allocated_len},"
                f" committed={self.kv_committed_len}, freed={self.kv_freed})")
