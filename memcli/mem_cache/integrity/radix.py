"""The prefix cache's checks: the radix tree walk of `RadixCache.check_integrity()`, and the
per-step `tree` check that runs it (or a cheaper sizes-and-pages check) against the layout.

Each check walks the tree (or its flattened values) and reports with numbers; none raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from memcli.mem_cache.eviction import is_evictable_leaf
from memcli.mem_cache.integrity.result import CheckResult, failed, joined, passed

if TYPE_CHECKING:
    from memcli.mem_cache.integrity.layout import Layout
    from memcli.mem_cache.radix_cache import RadixCache, TreeNode


def radix_checks(cache: RadixCache) -> list[CheckResult]:
    nodes = list(cache._iter_nodes())
    total, evictable, protected = cache._total, cache._evictable, cache._protected
    walked_total = sum(len(node.key) for node in nodes)
    walked_evictable = sum(len(node.key) for node in nodes if node.lock_ref == 0)
    walked_protected = sum(len(node.key) for node in nodes if node.lock_ref > 0)
    values = cache._cat([node.value for node in nodes if node.value is not None])
    checks = [
        CheckResult("total_size", walked_total == total, f"nodes hold {walked_total} tokens, total counter {total}"),
        CheckResult("evictable_plus_protected", evictable + protected == total,
                    f"evictable {evictable} + protected {protected} {_eq(evictable + protected, total)} total {total}"),
        CheckResult("evictable_size", walked_evictable == evictable,
                    f"unlocked nodes hold {walked_evictable} tokens, evictable counter {evictable}"),
        CheckResult("protected_size", walked_protected == protected,
                    f"locked nodes hold {walked_protected} tokens, protected counter {protected}"),
        CheckResult("node_count", len(nodes) == cache.num_nodes,
                    f"walked {len(nodes)} nodes, counter {cache.num_nodes}"),
        _lock_check(cache, nodes),
        _shape_check(nodes, cache.page_size),
        _child_key_check(cache, nodes),
        _unique_slot_check(nodes, values, cache.page_size),
        _free_slot_check(cache, values),
        _eviction_queue_check(cache, nodes),
    ]
    if cache.page_size > 1:
        checks.append(_page_layout_check(values, cache.page_size))
    return checks


def _eq(a: int, b: int) -> str:
    return "==" if a == b else "!="


def _first(bad: list[str], count: int, what: str) -> str:
    if not bad:
        return f"all {count} {what} ok"
    return f"{len(bad)} of {count} {what} bad, e.g. " + "; ".join(bad[:3])


def _lock_check(cache: RadixCache, nodes: list[TreeNode]) -> CheckResult:
    bad = [] if cache.root.lock_ref == 1 else [f"root lock_ref {cache.root.lock_ref} != 1"]
    for node in nodes:
        children_locks = sum(child.lock_ref for child in node.children.values())
        if node.lock_ref < 0 or node.lock_ref < children_locks:
            bad.append(f"node {node.id} lock_ref {node.lock_ref} < max(0, children's {children_locks})")
    return CheckResult("lock_refs", not bad, _first(bad, len(nodes), "nodes"))


def _shape_check(nodes: list[TreeNode], page_size: int) -> CheckResult:
    bad = []
    for node in nodes:
        key_len = len(node.key)
        value_len = -1 if node.value is None else len(node.value)
        if key_len != value_len or key_len == 0 or key_len % page_size:
            bad.append(f"node {node.id} key {key_len} value {value_len} (page_size {page_size})")
    return CheckResult("key_value_lengths", not bad, _first(bad, len(nodes), "nodes"))


def _child_key_check(cache: RadixCache, nodes: list[TreeNode]) -> CheckResult:
    bad = []
    for parent in [cache.root, *nodes]:
        for child_key, child in parent.children.items():
            expected = cache._child_key(child.extra_key, child.key, 0) if len(child.key) else None
            if child.parent is not parent:
                bad.append(f"node {child.id} listed under node {parent.id} but its parent is another node")
            elif child_key != expected:
                bad.append(f"node {child.id} registered under {child_key!r}, expected {expected!r}")
            elif parent is not cache.root and child.extra_key != parent.extra_key:
                bad.append(f"node {child.id} extra_key {child.extra_key!r} under {parent.extra_key!r}")
    return CheckResult("child_keys", not bad, _first(bad, len(nodes), "child links"))


def _duplicates(ids: torch.Tensor) -> torch.Tensor:
    """Ids that occur more than once (bincount: linear in len(ids) + max id, no sort)."""
    if len(ids) == 0:
        return ids
    return torch.nonzero(torch.bincount(ids) > 1).flatten()


def _unique_slot_check(nodes: list[TreeNode], values: torch.Tensor, page_size: int) -> CheckResult:
    dup_slots = _duplicates(values)
    detail = f"{len(dup_slots)} of {len(values)} slots owned by two nodes"
    if len(dup_slots):
        detail += f", e.g. {dup_slots[:5].tolist()}"
    ok = len(dup_slots) == 0
    if page_size > 1 and len(values) % page_size == 0:
        # One page per page_size run of slots (page_layout checks that the runs are pages).
        dup_pages = _duplicates(values.view(-1, page_size)[:, 0] // page_size)
        ok = ok and len(dup_pages) == 0
        detail += f"; {len(dup_pages)} pages owned by two nodes"
        if len(dup_pages):
            detail += f", e.g. {dup_pages[:5].tolist()}"
    return CheckResult("unique_slots", ok, detail)


def _free_slot_check(cache: RadixCache, values: torch.Tensor) -> CheckResult:
    if cache.allocator is None:
        return CheckResult("slots_not_free", True, "no allocator to compare with")
    free = cache.allocator.free_slot_ids().to(values.device)
    both = values[:0]
    if len(values) and len(free):
        is_free = torch.zeros(int(max(values.max(), free.max())) + 1, dtype=torch.bool, device=values.device)
        is_free[free] = True
        both = values[is_free[values]]
    detail = f"{len(both)} of {len(values)} tree slots are also in the allocator's {len(free)} free slots"
    if len(both):
        detail += f", e.g. {both[:5].tolist()}"
    return CheckResult("slots_not_free", len(both) == 0, detail)


def _eviction_queue_check(cache: RadixCache, nodes: list[TreeNode]) -> CheckResult:
    queued = cache._queue.live_seqs()
    leaves = [node for node in nodes if is_evictable_leaf(node)]
    missing = [f"node {node.id}" for node in leaves if node.heap_seq not in queued]
    return CheckResult("eviction_queue", not missing, _first(missing, len(leaves), "evictable leaves queued"))


def _page_layout_check(values: torch.Tensor, page_size: int) -> CheckResult:
    if len(values) % page_size:
        return CheckResult("page_layout", False, f"{len(values)} tree slots is not a multiple of page_size {page_size}")
    pages = values.view(-1, page_size)
    expected = pages[:, :1] + torch.arange(page_size, device=values.device)
    bad = (pages[:, 0] % page_size != 0) | (pages != expected).any(dim=1)
    detail = f"{int(bad.sum())} of {len(pages)} tree pages not page-aligned runs of consecutive slots"
    return CheckResult("page_layout", not bool(bad.any()), detail)


# -- the per-step tree check ---------------------------------------------------------------


def check_tree(stack: Any, layout: Layout, full: bool = True) -> CheckResult:
    """The prefix cache's integrity.

    For a radix tree, every call checks the size counters (evictable + protected == total ==
    slots in its nodes) and that its slots are distinct whole pages; with `full` it also runs the
    cache's own `check_integrity()` walk (locks, child keys, eviction queue), which costs more.
    Caches without a tree always run their (cheap) `check_integrity()`."""
    tree = stack.tree_cache
    is_tree = hasattr(tree, "all_values_flatten")
    if full or not is_tree:
        report = tree.check_integrity()
        if not report.ok:
            return failed("tree", f"{report.component}: {joined(report.failures)}")
        if not is_tree:
            return passed("tree", f"{report.component}: {len(report.checks)} checks hold")
    problem = _tree_pages_problem(tree, layout)
    if problem is not None:
        return failed("tree", f"{type(tree).__name__}: {problem}")
    walk = "full walk" if full else "sizes and pages"
    return passed("tree", f"{tree.total_size()} cached tokens (evictable {tree.evictable_size()}, protected"
                          f" {tree.protected_size()}); {walk} ok")


def _tree_pages_problem(tree: Any, layout: Layout) -> Optional[str]:
    ps, slots = layout.page_size, layout.tree_slots
    total, evictable, protected = tree.total_size(), tree.evictable_size(), tree.protected_size()
    if evictable + protected != total or len(slots) != total:
        return f"evictable {evictable} + protected {protected}, total {total}, {len(slots)} slots in its nodes"
    if not len(slots):
        return None
    end = (layout.num_pages + 1) * ps
    if slots.min() < ps or slots.max() >= end:
        return f"a cached slot lies outside [{ps}, {end})"
    if np.bincount(slots, minlength=end).max() > 1:
        return "a slot is cached twice (held by two tree nodes)"
    if len(slots) % ps:
        return f"{len(slots)} cached slots is not a whole number of pages of {ps}"
    pages = slots.reshape(-1, ps)
    bad = np.flatnonzero((pages[:, 0] % ps != 0) | (pages != pages[:, :1] + np.arange(ps)).any(axis=1))
    if len(bad):
        return f"cached slots {pages[bad[0]].tolist()} are not one whole page"
    return None
