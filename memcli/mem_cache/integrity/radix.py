"""The per-step `tree` check: the prefix cache's own `check_integrity()` walk (the tree's
`memcli.mem_cache.tree_checks`), or a cheaper sizes-and-pages check, against the layout.

Reads the cache through its public interface only (sizes, `all_values_flatten`,
`check_integrity`); reports with numbers, never raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from memcli.check_result import CheckResult, failed, joined, passed

if TYPE_CHECKING:
    from memcli.mem_cache.integrity.layout import Layout


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
