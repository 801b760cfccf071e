"""A plain radix tree, token by token: the baseline of `memcli bench-radix` only.

This is the straightforward design (keys as Python lists, a Python loop comparing tokens,
a heap built over all leaves on every `evict`). It mirrors `RadixCache`'s match, insert and
eviction semantics so both report the same matches on the same workload; nothing else in
memcli uses it.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable, Optional

import torch

from memcli.mem_cache.pages import align_down


class BaselineNode:
    _ids = itertools.count()

    def __init__(self, parent: Optional["BaselineNode"], key: list[int], value: Optional[torch.Tensor], now: float):
        self.children: dict = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = now
        self.id = next(BaselineNode._ids)


class BaselineRadixCache:
    """Token-by-token radix tree with LRU eviction. Keys are lists of ints."""

    def __init__(self, allocator, page_size: int, clock: Callable[[], float] = time.monotonic):
        self.allocator = allocator
        self.page_size = page_size
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        self.root = BaselineNode(None, [], None, self.clock())
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def _child_key(self, key: list[int]):
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, key0: list[int], key1: list[int]) -> int:
        ps = self.page_size
        i = 0
        if ps == 1:
            for a, b in zip(key0, key1):
                if a != b:
                    break
                i += 1
            return i
        limit = min(len(key0), len(key1))
        while i + ps <= limit and key0[i : i + ps] == key1[i : i + ps]:
            i += ps
        return i

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, BaselineNode]:
        key = key[: align_down(len(key), self.page_size)]
        now = self.clock()
        node, values = self.root, []
        node.last_access_time = now
        while key and self._child_key(key) in node.children:
            child = node.children[self._child_key(key)]
            n = self._match_len(child.key, key)
            diverged = n < len(child.key)
            if diverged:
                child = self._split(child, n)
            child.last_access_time = now
            values.append(child.value)
            node = child
            if diverged:
                break
            key = key[n:]
        indices = torch.cat(values) if values else torch.empty((0,), dtype=torch.int64)
        return indices, node

    def _split(self, child: BaselineNode, n: int) -> BaselineNode:
        upper = BaselineNode(child.parent, child.key[:n], child.value[:n], child.last_access_time)
        upper.lock_ref = child.lock_ref
        upper.children = {self._child_key(child.key[n:]): child}
        child.parent.children[self._child_key(child.key)] = upper
        child.parent, child.key, child.value = upper, child.key[n:], child.value[n:]
        return upper

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        aligned = align_down(len(key), self.page_size)
        key, value = key[:aligned], value[:aligned]
        now = self.clock()
        node, total_prefix = self.root, 0
        node.last_access_time = now
        while key and self._child_key(key) in node.children:
            child = node.children[self._child_key(key)]
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            total_prefix += n
            key, value, node = key[n:], value[n:], child
        if key:
            leaf = BaselineNode(node, key, value, now)
            node.children[self._child_key(key)] = leaf
            self._evictable += len(key)
        return total_prefix

    def _leaves(self) -> list[BaselineNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children:
                leaves.append(node)
            stack.extend(node.children.values())
        return leaves

    def evict(self, num_tokens: int) -> int:
        heap = [(leaf.last_access_time, leaf.id, leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node is self.root:
                break
            if node.lock_ref > 0:
                continue
            self.allocator.free(node.value)
            evicted += len(node.key)
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            self._evictable -= len(node.key)
            if not parent.children:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return evicted
