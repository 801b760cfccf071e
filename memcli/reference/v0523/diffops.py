"""Operation-level differential: SGLang 0.5.23's `UnifiedRadixCache` (both tree cores) vs
memcli's radix cache under the `sglang-0.5.23` profile.

    divergence = find_divergence_0523(worker, seed=3, page_size=16, policy="lru", num_ops=60, core="rust")

The operations are `memcli.reference.ops.generate_ops`'s; the reference runs them in the
0.5.23 worker (`memcli.reference.v0523.ops`), memcli here, and the observations are compared
after every operation: the result (with every free the insert made), the sizes and the free
list; on the Python core also the tree and the order its leaves would be evicted in (the Rust
core's nodes cannot be read from Python).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from memcli.config import SemanticsConfig
from memcli.mem_cache.allocator import make_allocator
from memcli.mem_cache.base_prefix_cache import RadixKey
from memcli.mem_cache.clock import LogicalClock
from memcli.mem_cache.radix_cache import RadixCache
from memcli.reference.ops import Op, _in_tree, generate_ops
from memcli.stack import radix_semantics

PROFILE = "sglang-0.5.23"


class Divergence0523(NamedTuple):
    index: int  # the operation (-1: the empty stack)
    op: Optional[Op]
    field: str
    reference: Any
    memcli: Any

    def __str__(self) -> str:
        return f"op {self.index} {self.op!r}: {self.field} differs\n  sglang: {self.reference}\n  memcli: {self.memcli}"


def _record_frees(allocator: Any, freed: list) -> None:
    real_free, ps = allocator.free, allocator.page_size

    def free(indices, *args, segment: bool = False, **kwargs):
        if indices.numel():
            flat = indices.reshape(-1).tolist()
            if ps == 1:
                freed.append(flat)
            else:
                freed.append([s // ps for s in flat[::ps]] if segment else sorted({s // ps for s in flat}))
        return real_free(indices, *args, segment=segment, **kwargs)

    allocator.free = free


class _MemcliSide:
    def __init__(self, size: int, page_size: int, policy: str, semantics: SemanticsConfig):
        self.allocator = make_allocator(size, page_size, torch.device("cpu"), "torch")
        self.tree = RadixCache(None, self.allocator, page_size, eviction_policy=policy,
                               **radix_semantics(semantics.resolved()))
        self.tree.clock = LogicalClock()
        self.freed: list = []
        _record_frees(self.allocator, self.freed)
        self.handles: dict[int, Any] = {}
        self.locks: dict[int, int] = {}

    def apply(self, index: int, op: Op) -> Any:
        tree, kind, arg = self.tree, op.kind, op.arg
        self.freed.clear()
        if kind == "insert":
            if self.allocator.available_size() < len(arg):
                return "skipped: no room"
            value = self.allocator.alloc(len(arg))
            prefix_len, _ = tree.insert_unified(RadixKey(list(arg)), value.clone())
            return ["prefix_len", int(prefix_len), "slots", value.tolist(), "freed", list(self.freed)]
        if kind == "match":
            result = tree.match_prefix(RadixKey(list(arg)))
            self.handles[index] = result[1]
            return ["len", len(result[0]), "indices", result[0].tolist()]
        if kind in ("lock", "unlock"):
            return self._lock(kind, arg)
        if kind == "evict":
            tree.evict(arg)
            return ["freed", list(self.freed)]
        raise ValueError(f"unknown op kind {kind!r}")

    def _lock(self, kind: str, handle: int) -> Any:
        node = self.handles.get(handle)
        if node is None or node.value is None or not _in_tree(node, self.tree.root):
            return "skipped: no such node"
        if kind == "unlock" and not self.locks.get(handle):
            return "skipped: not locked"
        before = self.tree.protected_size()
        if kind == "lock":
            self.tree.inc_lock_ref(node)
        else:
            self.tree.dec_lock_ref(node)
        self.locks[handle] = self.locks.get(handle, 0) + (1 if kind == "lock" else -1)
        return ["delta", self.tree.protected_size() - before]

    def observe(self, result: Any, full: bool) -> dict:
        tree, alloc = self.tree, self.allocator
        obs = {"result": result, "free_list": alloc.free_page_ids().tolist(),
               "sizes": [alloc.available_size(), tree.evictable_size(), tree.protected_size()]}
        if full:
            obs["tree"] = _shape(tree.root)
            obs["leaf_order"] = _leaf_order(tree)
        return obs


def _shape(node: Any) -> list:
    return sorted([[int(t) for t in c.key], c.value.tolist(), c.lock_ref, _shape(c)] for c in node.children.values())


def _path(node: Any) -> list[int]:
    parts = []
    while node.parent is not None:
        parts.append([int(t) for t in node.key])
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def _leaf_order(tree: RadixCache) -> list[list[int]]:
    nodes, stack = [], list(tree.root.children.values())
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    leaves = [n for n in nodes if not n.children and n.lock_ref == 0]
    leaves.sort(key=lambda n: (tree.priority(n), _path(n)))
    return [_path(n) for n in leaves]


def run_ops_0523(worker: Any, ops: list[Op], page_size: int, policy: str = "lru", core: str = "rust",
                 size: Optional[int] = None, semantics: Optional[SemanticsConfig] = None) -> Optional[Divergence0523]:
    """The first divergence of `ops` between 0.5.23 (on `core`) and memcli, or None."""
    size = size or 16 * page_size
    wire = [[op.kind, list(op.arg) if isinstance(op.arg, tuple) else op.arg] for op in ops]
    reference = worker.call("ops", ops=wire, page_size=page_size, policy=policy, core=core, size=size)
    side = _MemcliSide(size, page_size, policy, semantics or SemanticsConfig(engine=PROFILE, profile=PROFILE))
    full = core == "python"
    mine = [side.observe(None, full)] + [side.observe(side.apply(i, op), full) for i, op in enumerate(ops)]
    for index, (ref_obs, mem_obs) in enumerate(zip(reference, mine)):
        for name in ref_obs:
            if ref_obs[name] != mem_obs[name]:
                return Divergence0523(index - 1, ops[index - 1] if index else None, name, ref_obs[name], mem_obs[name])
    return None


def find_divergence_0523(worker: Any, seed: int, page_size: int, policy: str, num_ops: int,
                         core: str = "rust") -> Optional[Divergence0523]:
    return run_ops_0523(worker, generate_ops(seed, page_size, num_ops, policy), page_size, policy, core)
