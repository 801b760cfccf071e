"""The tree walks behind `RadixCache.check_integrity()` and `HiRadixCache.check_integrity()`.

Each walk reads a `TreeView` (the tree's nodes and counters, `RadixCache.view()`), never the
tree's private state, and reports with numbers; none raises. The host-tier checks read the
hierarchical cache's public state (host pool, copies in flight, controller queues).

Host tier invariants (besides the radix tree's, over device slots):

    host conservation     free host slots + host slots held by nodes == host pool size
                          (a copy in flight is held by its node from the moment it starts)
    evicted => backed up  a node without device slots has a host copy
    host-only subtrees    below an evicted node every node is evicted (no device slots)
    copies in flight      every node with a write or a load in flight is in the tree and locked

A leaf below the trees: it imports neither them nor `memcli.mem_cache.integrity`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch

from memcli.check_result import CheckResult, failed, passed


class TreeView(NamedTuple):
    """A radix tree as one walk reads it, taken at once (`RadixCache.view()`): its nodes, as
    they are (read, never written), and its counters."""

    root: Any
    nodes: list  # every node but the root, parents before children
    total: int  # the tree's counters: cached (device) tokens, of them unlocked and locked
    evictable: int
    protected: int
    num_nodes: int
    page_size: int
    child_key: Callable[[Any], Any]  # the key a node is registered under in its parent's children
    queues: tuple  # (what, EvictionQueue): "" for the radix tree's one queue, "device" and "host"
    allocator: Any  # where the device slots come from (`free_slot_ids`), or None
    empty: torch.Tensor  # no slots, on the tree's device

    def device_slots(self, nodes: list) -> torch.Tensor:
        """The device slots of `nodes` (evicted ones hold none), as one tensor."""
        values = [node.value for node in nodes if node.value is not None]
        return torch.cat(values) if values else self.empty


def radix_checks(view: TreeView) -> list[CheckResult]:
    """The radix walk: counters against the nodes, locks, shapes, slots and the eviction queue."""
    nodes = view.nodes
    walked_protected = sum(len(node.key) for node in nodes if node.lock_ref > 0)
    protected = CheckResult("protected_size", walked_protected == view.protected,
                            f"locked nodes hold {walked_protected} tokens, protected counter {view.protected}")
    return _walk_checks(view, nodes, "nodes", [protected], _shape_check(nodes, view.page_size),
                        [_eviction_queue_check(view)])


def hiradix_checks(view: TreeView, cache: Any) -> list[CheckResult]:
    """The radix walk over device slots, both eviction queues, and the host tier of `cache`."""
    nodes = view.nodes
    device = [n for n in nodes if n.value is not None]
    return _walk_checks(view, device, "device nodes", [], _host_shape_check(nodes, view.page_size),
                        [_queues_check(view), *host_tier_checks(cache, nodes)], sum_detail=_listed_sum)


def _walk_checks(view: TreeView, holders: list, what: str, counters: list[CheckResult], shape: CheckResult,
                 queues: list[CheckResult], sum_detail: Optional[Callable[[int, int, int], str]] = None) -> list[CheckResult]:
    """The checks both walks share, over `holders` (the nodes that hold device slots), in this
    order: the size counters (then the walk's own `counters`), the node count, locks, `shape`,
    child keys, slots, `queues`, and the page layout at page size > 1. `sum_detail`
    words the evictable + protected check (`_compared_sum` unless given)."""
    sum_detail = sum_detail or _compared_sum
    total, evictable, protected = view.total, view.evictable, view.protected
    walked = sum(len(node.key) for node in holders)
    walked_evictable = sum(len(node.key) for node in holders if node.lock_ref == 0)
    values = view.device_slots(holders)
    marks = _slot_marks(values)
    sizes = [
        CheckResult("total_size", walked == total, f"{what} hold {walked} tokens, total counter {total}"),
        CheckResult("evictable_plus_protected", evictable + protected == total,
                    sum_detail(evictable, protected, total)),
        CheckResult("evictable_size", walked_evictable == evictable,
                    f"unlocked {what} hold {walked_evictable} tokens, evictable counter {evictable}"),
    ]
    checks = [
        *sizes, *counters,
        CheckResult("node_count", len(view.nodes) == view.num_nodes,
                    f"walked {len(view.nodes)} nodes, counter {view.num_nodes}"),
        _lock_check(view),
        shape,
        _child_key_check(view),
        _unique_slot_check(values, view.page_size, marks),
        _free_slot_check(view.allocator, values, marks),
        *queues,
    ]
    if view.page_size > 1:
        checks.append(_page_layout_check(values, view.page_size))
    return checks


def _compared_sum(evictable: int, protected: int, total: int) -> str:
    return f"evictable {evictable} + protected {protected} {_eq(evictable + protected, total)} total {total}"


def _listed_sum(evictable: int, protected: int, total: int) -> str:
    return f"evictable {evictable} + protected {protected}, total {total}"


# -- the radix tree ------------------------------------------------------------------------


def _eq(a: int, b: int) -> str:
    return "==" if a == b else "!="


def _first(bad: list[str], count: int, what: str) -> str:
    if not bad:
        return f"all {count} {what} ok"
    return f"{len(bad)} of {count} {what} bad, e.g. " + "; ".join(bad[:3])


def _lock_check(view: TreeView) -> CheckResult:
    nodes = view.nodes
    bad = [] if view.root.lock_ref == 1 else [f"root lock_ref {view.root.lock_ref} != 1"]
    for node in nodes:
        children_locks = sum(child.lock_ref for child in node.children.values())
        if node.lock_ref < 0 or node.lock_ref < children_locks:
            bad.append(f"node {node.id} lock_ref {node.lock_ref} < max(0, children's {children_locks})")
    return CheckResult("lock_refs", not bad, _first(bad, len(nodes), "nodes"))


def _shape_check(nodes: list, page_size: int) -> CheckResult:
    bad = []
    for node in nodes:
        key_len = len(node.key)
        value_len = -1 if node.value is None else len(node.value)
        if key_len != value_len or key_len == 0 or key_len % page_size:
            bad.append(f"node {node.id} key {key_len} value {value_len} (page_size {page_size})")
    return CheckResult("key_value_lengths", not bad, _first(bad, len(nodes), "nodes"))


def _child_key_check(view: TreeView) -> CheckResult:
    nodes, root = view.nodes, view.root
    bad = []
    for parent in [root, *nodes]:
        for child_key, child in parent.children.items():
            expected = view.child_key(child) if len(child.key) else None
            if child.parent is not parent:
                bad.append(f"node {child.id} listed under node {parent.id} but its parent is another node")
            elif child_key != expected:
                bad.append(f"node {child.id} registered under {child_key!r}, expected {expected!r}")
            elif parent is not root and child.extra_key != parent.extra_key:
                bad.append(f"node {child.id} extra_key {child.extra_key!r} under {parent.extra_key!r}")
    return CheckResult("child_keys", not bad, _first(bad, len(nodes), "child links"))


def _slot_marks(ids: torch.Tensor) -> Optional[np.ndarray]:
    """On a CPU, one flag per id from 0 to the largest of `ids`, set where an id occurs (one
    scatter over the tensor's memory); None on a device, for no ids, or for a negative id,
    which the tensor paths judge."""
    if not len(ids) or not ids.is_cpu:
        return None
    host = ids.numpy()
    if int(host.min()) < 0:
        return None
    marks = np.zeros(int(host.max()) + 1, dtype=np.bool_)
    marks[host] = True
    return marks


def _duplicates(ids: torch.Tensor, marks: Optional[np.ndarray]) -> torch.Tensor:
    """Ids that occur more than once, ascending (bincount: linear in len(ids) + max id, no
    sort). `marks`: `_slot_marks(ids)`, which on a CPU answers the usual case, no id twice,
    with one count: as many ids set as there are ids."""
    if len(ids) == 0:
        return ids
    if marks is not None and np.count_nonzero(marks) == len(ids):
        return ids[:0]
    return torch.nonzero(torch.bincount(ids) > 1).flatten()


def _unique_slot_check(values: torch.Tensor, page_size: int, marks: Optional[np.ndarray]) -> CheckResult:
    """No slot, and at page size > 1 no page, held by two nodes. `marks`: `_slot_marks(values)`."""
    dup_slots = _duplicates(values, marks)
    detail = f"{len(dup_slots)} of {len(values)} slots owned by two nodes"
    if len(dup_slots):
        detail += f", e.g. {dup_slots[:5].tolist()}"
    ok = len(dup_slots) == 0
    if page_size > 1 and len(values) % page_size == 0:
        # One page per page_size run of slots (page_layout checks that the runs are pages).
        first_pages = values.view(-1, page_size)[:, 0] // page_size
        dup_pages = _duplicates(first_pages, _slot_marks(first_pages))
        ok = ok and len(dup_pages) == 0
        detail += f"; {len(dup_pages)} pages owned by two nodes"
        if len(dup_pages):
            detail += f", e.g. {dup_pages[:5].tolist()}"
    return CheckResult("unique_slots", ok, detail)


def _free_slot_check(allocator: Any, values: torch.Tensor, marks: Optional[np.ndarray] = None) -> CheckResult:
    """No tree slot is in the allocator's free list. `marks`: `_slot_marks(values)`, with which
    the free slots are looked up in the tree's marks (one gather over the free list) and the
    tree's slots are gathered only when one is found."""
    if allocator is None:
        return CheckResult("slots_not_free", True, "no allocator to compare with")
    both = values[:0]
    if not len(values):  # an empty tree (the idle walk before the first request): no free list to gather
        num_free = allocator.available_size()  # the length of `free_slot_ids()`
    else:
        free = allocator.free_slot_ids().to(values.device)
        num_free = len(free)
        if num_free and (marks is None or _any_marked(marks, free.numpy())):
            is_free = torch.zeros(int(max(values.max(), free.max())) + 1, dtype=torch.bool, device=values.device)
            is_free[free] = True
            both = values[is_free[values]]
    detail = f"{len(both)} of {len(values)} tree slots are also in the allocator's {num_free} free slots"
    if len(both):
        detail += f", e.g. {both[:5].tolist()}"
    return CheckResult("slots_not_free", len(both) == 0, detail)


def _any_marked(marks: np.ndarray, ids: np.ndarray) -> bool:
    """Whether any of `ids` is set in `marks` (ids past the marks, or negative, are not)."""
    if int(ids.min()) >= 0 and int(ids.max()) < len(marks):
        return bool(np.count_nonzero(marks[ids]))
    return bool(np.count_nonzero(marks[ids[(ids >= 0) & (ids < len(marks))]]))


def _eviction_queue_check(view: TreeView) -> CheckResult:
    queue = view.queues[0][1]  # the radix tree's one queue
    queued = queue.live_seqs()
    leaves = [node for node in view.nodes if queue.is_leaf(node)]
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


# -- the host tier -------------------------------------------------------------------------


def _host_shape_check(nodes: list, page_size: int) -> CheckResult:
    bad = []
    for node in nodes:
        key_len = len(node.key)
        lens = [len(v) for v in (node.value, node.host_value) if v is not None]
        if not lens or any(n != key_len for n in lens) or key_len == 0 or key_len % page_size:
            bad.append(f"node {node.id} key {key_len}, device {_len(node.value)}, host {_len(node.host_value)}")
    return CheckResult("key_value_lengths", not bad, _first(bad, len(nodes), "nodes"))


def _len(value: Any) -> str:
    return "none" if value is None else str(len(value))


def _queues_check(view: TreeView) -> CheckResult:
    nodes, missing = view.nodes, []
    for what, queue in view.queues:
        queued = queue.live_seqs()
        missing += [f"{what} leaf {n.id}" for n in nodes if queue.is_leaf(n) and n.heap_seq not in queued]
    return CheckResult("eviction_queue", not missing, _first(missing, len(nodes), "nodes"))


def host_tier_checks(cache: Any, nodes: list | None = None) -> list[CheckResult]:
    """The host-tier invariants of the module docstring. With `nodes` (a full walk) every node
    is checked; without, only the counters and the copies in flight (O(copies in flight))."""
    results = [_host_conservation(cache, nodes), _in_flight(cache)]
    if nodes is not None:
        results += [_evicted_backed_up(nodes), _host_only_subtrees(nodes)]
    return results


def _host_conservation(cache: Any, nodes: list | None) -> CheckResult:
    pool = cache.host_pool
    free, held, size = pool.available_size(), cache.host_size(), pool.size
    in_flight = sum(len(n.host_value) for n in cache.ongoing_write.values() if n.host_value is not None)
    detail = f"free {free} + held by the tree {held} (in flight {in_flight}) = {free + held} vs size {size}"
    if free + held != size:
        return failed("host_conservation", "host slots lost or freed twice: " + detail)
    if nodes is not None:
        host = [n.host_value for n in nodes if n.host_value is not None]
        slots = torch.cat(host).numpy() if host else np.empty(0, dtype=np.int64)
        if len(slots) != held:
            return failed("host_conservation", f"nodes hold {len(slots)} host slots, counter {held}")
        free_ids = pool.free_slot_ids()
        for ids in (slots, free_ids):
            if len(ids) and (ids.min() < 0 or ids.max() >= size):
                return failed("host_conservation", f"a host slot lies outside [0, {size})")
        # One byte per slot (the pool can hold a billion): every slot marked once, or one is held twice.
        seen = np.zeros(size, dtype=bool)
        seen[free_ids] = True
        seen[slots] = True
        if int(np.count_nonzero(seen)) != len(free_ids) + len(slots):
            return failed("host_conservation", "a host slot is held twice (two nodes, or a node and the free list)")
    return passed("host_conservation", detail)


def _in_flight(cache: Any) -> CheckResult:
    bad = []
    ctl = cache.controller
    queued_loads = [i for ack in ctl.ack_load_queue for i in ack.node_ids] + [op.node_id for op in ctl.load_queue]
    for what, ongoing, ids in (("write", cache.ongoing_write, [i for ack in ctl.ack_write_queue for i in ack.node_ids]),
                               ("load", cache.ongoing_load, queued_loads)):
        if sorted(ids) != sorted(ongoing):
            bad.append(f"{len(ongoing)} nodes with a {what} in flight, {len(ids)} copies queued or running")
        for node in ongoing.values():
            locked = node.lock_ref > 0 or (what == "write" and cache.write_policy == "write_back")
            if node.parent is None or not locked:
                bad.append(f"node {node.id} with a {what} in flight is {'not in the tree' if node.parent is None else 'unlocked'}")
            if what == "write" and node.host_value is None:
                bad.append(f"node {node.id} has a write in flight but no host slots")
    if bad:
        return failed("copies_in_flight", "; ".join(bad[:3]))
    return passed("copies_in_flight", f"{len(cache.ongoing_write)} writes, {len(cache.ongoing_load)} loads in"
                                      " flight, every node locked")


def _evicted_backed_up(nodes: list) -> CheckResult:
    bad = [f"node {n.id}" for n in nodes if n.value is None and n.host_value is None]
    return CheckResult("evicted_backed_up", not bad, _first(bad, len(nodes), "nodes (evicted without a host copy)"))


def _host_only_subtrees(nodes: list) -> CheckResult:
    bad = [f"node {c.id} under evicted node {n.id}" for n in nodes if n.value is None
           for c in n.children.values() if c.value is not None]
    return CheckResult("host_only_subtrees", not bad, _first(bad, len(nodes), "nodes (device slots below an evicted node)"))
