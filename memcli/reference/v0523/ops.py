"""Operations on SGLang 0.5.23's real `UnifiedRadixCache` (worker side of the op-level diff).

`run_reference_ops(ref, ops, page_size, policy, core, size)` applies the operations of
`memcli.reference.ops` (insert, match, lock, unlock, evict; as `[kind, arg]` pairs) to the
real tree on `core` and returns one observation per operation, in JSON types:

    {"result": ..., "sizes": [available, evictable, protected], "free_list": [...],
     "tree": [...] (the Python core only: the Rust core's nodes are not Python objects),
     "leaf_order": [...] (likewise)}

An insert allocates `len(tokens)` slots and inserts them with `prev_prefix_len = 0`: the
tree frees the duplicate slots itself (0.5.23's insert walk). Every free the allocator
receives during an operation is recorded, in order, as `freed`.
"""

from __future__ import annotations

from array import array
from typing import Any, Optional

from memcli.reference.v0523.stack import build_stack_0523


def _record_frees(allocator: Any, freed: list) -> None:
    """Record the slots of every `free` and the page ids of every `free_page_ids` (in order)."""
    real_free = allocator.free
    real_pages = getattr(allocator, "free_page_ids", None)
    ps = allocator.page_size

    def free(indices, *args, **kwargs):
        if indices.numel():
            freed.append(sorted({int(i) // ps for i in indices.reshape(-1).tolist()}) if ps > 1
                         else indices.reshape(-1).tolist())
        return real_free(indices, *args, **kwargs)

    def free_page_ids(page_ids, *args, **kwargs):
        if page_ids.numel():
            freed.append(page_ids.reshape(-1).tolist())
        return real_pages(page_ids, *args, **kwargs)

    allocator.free = free
    if real_pages is not None and ps > 1:
        allocator.free_page_ids = free_page_ids


def _free_list(allocator: Any) -> list[int]:
    if allocator.page_size > 1:
        return allocator.get_all_free_pages().tolist() if hasattr(allocator, "get_all_free_pages") \
            else allocator.free_pages.tolist()
    return [*allocator.free_pages.tolist(), *allocator.release_pages.tolist()]


def _shape(node: Any) -> list:
    out = []
    for child in node.children.values():
        value = child.component_data[0].value
        out.append([list(child.key.token_ids), value.tolist() if value is not None else None,
                    child.component_data[0].lock_ref, _shape(child)])
    return sorted(out)


def _path(node: Any) -> list[int]:
    parts = []
    while node.parent is not None:
        parts.append(list(node.key.token_ids))
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def _leaf_order(core: Any) -> list[list[int]]:
    nodes, stack = [], list(core.root_node.children.values())
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    leaves = [n for n in nodes if not n.children and n.component_data[0].lock_ref == 0]
    priority = core.eviction_strategy.get_priority
    leaves.sort(key=lambda n: (priority(n), _path(n)))
    return [_path(n) for n in leaves]


class _RefSide:
    def __init__(self, ref: Any, size: int, page_size: int, policy: str, core: str):
        self.ref = ref
        self.stack = build_stack_0523(ref, size, page_size, core, policy)
        self.tree, self.allocator = self.stack.tree, self.stack.allocator
        self.freed: list = []
        _record_frees(self.allocator, self.freed)
        self.handles: dict[int, Any] = {}
        self.locks: dict[int, list] = {}
        self.python_core = core == "python"

    def key(self, tokens: list[int]) -> Any:
        return self.ref.RadixKey(array("q", tokens), None)

    def apply(self, index: int, kind: str, arg: Any) -> Any:
        ref, tree = self.ref, self.tree
        self.freed.clear()
        if kind == "insert":
            if self.allocator.available_size() < len(arg):
                return "skipped: no room"
            value = self.allocator.alloc(len(arg))
            if value is None:
                return "alloc returned None"
            result = tree.insert(ref.InsertParams(key=self.key(arg), value=value.clone(), prev_prefix_len=0))
            return ["prefix_len", int(result.prefix_len), "slots", value.tolist(), "freed", list(self.freed)]
        if kind == "match":
            result = tree.match_prefix(ref.MatchPrefixParams(key=self.key(arg)))
            node = result.last_device_node
            self.handles[index] = node
            indices = tree.path_device_indices(node)[: result.device_prefix_len]
            return ["len", int(result.device_prefix_len), "indices", indices.tolist()]
        if kind in ("lock", "unlock"):
            return self._lock(kind, arg)
        if kind == "evict":
            tree.evict(ref.EvictParams(num_tokens=arg))
            return ["freed", list(self.freed)]
        raise ValueError(f"unknown op kind {kind!r}")

    def _lock(self, kind: str, handle: int) -> Any:
        node = self.handles.get(handle)
        if node is None or not self._in_tree(node):
            return "skipped: no such node"
        held = self.locks.setdefault(handle, [])
        before = self.tree.protected_size()
        if kind == "lock":
            held.append(self.tree.lock(node))
        elif not held:
            return "skipped: not locked"
        else:
            self.tree.unlock(held.pop())
        return ["delta", self.tree.protected_size() - before]

    def _in_tree(self, node_id: Any) -> bool:
        try:
            return not self.tree.tree_core.is_full_device_evicted(node_id)
        except (KeyError, AssertionError, IndexError, RuntimeError, ValueError):
            return False

    def observe(self, result: Any) -> dict:
        tree = self.tree
        obs = {"result": result, "free_list": _free_list(self.allocator),
               "sizes": [self.allocator.available_size(), tree.evictable_size(), tree.protected_size()]}
        if self.python_core:
            core = tree.tree_core
            obs["tree"] = _shape(core.root_node)
            obs["leaf_order"] = _leaf_order(core)
        return obs


def run_reference_ops(ref: Any, ops: list, page_size: int, policy: str = "lru", core: str = "rust",
                      size: Optional[int] = None) -> list[dict]:
    """One observation per operation (the first, index -1, is the empty stack's)."""
    side = _RefSide(ref, size or 16 * page_size, page_size, policy, core)
    observations = [side.observe(None)]
    for index, (kind, arg) in enumerate(ops):
        observations.append(side.observe(side.apply(index, kind, arg)))
    return observations
