"""Eviction policies for the radix cache, and the lazy queue of evictable leaves.

A policy is a priority function of a tree node: the leaf with the smallest priority is
evicted first. Add a policy by adding an entry to `EVICTION_POLICIES`. `belady` (offline) is
the one policy that reads the trace's future: the radix cache computes its priority.

Contract between a policy and the queue: a node's priority may change only when the node
is accessed (match or insert through it); the cache re-queues a leaf every time it
touches it, so the queue never needs to be rebuilt on each eviction.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Iterable, Iterator, Optional

PriorityFn = Callable[[Any], Any]


def lru_priority(node: Any) -> Any:
    """Least recently used first."""
    return node.last_access_time


def lfu_priority(node: Any) -> Any:
    """Fewest hits first; among equal counts the least recently used."""
    return (node.hit_count, node.last_access_time)


def fifo_priority(node: Any) -> Any:
    """Oldest cached first, whatever its use."""
    return node.creation_time


def belady_priority(node: Any) -> Any:
    """Offline: the page next used furthest in the future first. It reads the trace's future,
    so the radix cache computes it (`RadixCache._belady_priority`); this entry only names it."""
    raise ValueError("the belady priority is computed by the radix cache from the trace's future uses")


EVICTION_POLICIES: dict[str, PriorityFn] = {
    "lru": lru_priority,
    "lfu": lfu_priority,
    "fifo": fifo_priority,
    "belady": belady_priority,
}


def get_eviction_policy(name: str) -> PriorityFn:
    """The priority function called `name` (case-insensitive); ValueError names the valid ones."""
    try:
        return EVICTION_POLICIES[name.lower()]
    except KeyError:
        valid = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; valid policies: {valid}") from None


def is_evictable_leaf(node: Any) -> bool:
    """Still in the tree (has a parent and a value), has no children, and nobody locks it."""
    return node.parent is not None and node.value is not None and not node.children and node.lock_ref == 0


class EvictionQueue:
    """Min-heap of evictable leaves, kept across `evict` calls and validated lazily.

    Every `push(node)` supersedes the node's earlier entries (the node remembers the
    sequence number of its live entry in `heap_seq`; a node sits in at most one queue's
    live entry at a time). `pop` discards entries that are superseded or
    whose node is no longer an evictable leaf, and re-queues a live entry whose priority
    changed without a push. Cost: O(log n) per push or pop, no scan of the tree.
    """

    def __init__(self, priority: PriorityFn, is_leaf: Callable[[Any], bool] = is_evictable_leaf,
                 seq: Optional[Iterator[int]] = None):
        self.priority = priority
        self.is_leaf = is_leaf  # which nodes may be popped (the hierarchical cache has two kinds)
        self._heap: list[tuple[Any, int, Any]] = []
        self._seq = seq if seq is not None else itertools.count()  # queues over the same nodes share one

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: Any) -> None:
        seq = next(self._seq)
        node.heap_seq = seq
        heapq.heappush(self._heap, (self.priority(node), seq, node))

    def pop(self) -> Optional[Any]:
        """The evictable leaf with the smallest priority, removed from the queue; None if none."""
        heap = self._heap
        while heap:
            priority, seq, node = heapq.heappop(heap)
            if seq != node.heap_seq or not self.is_leaf(node):
                continue
            if self.priority(node) != priority:
                self.push(node)
                continue
            node.heap_seq = -1
            return node
        return None

    def live_seqs(self) -> set[int]:
        """Sequence numbers of all entries (for integrity checks)."""
        return {seq for _, seq, _ in self._heap}

    def rebuild(self, leaves: Iterable[Any]) -> None:
        """Drop every entry and queue exactly `leaves` (used to shed stale entries)."""
        self._heap = []
        for node in leaves:
            seq = next(self._seq)
            node.heap_seq = seq
            self._heap.append((self.priority(node), seq, node))
        heapq.heapify(self._heap)
