"""The hierarchical cache's checks: the tree walk of `HiRadixCache.check_integrity()` and the
cheap per-step host-tier check that `--check incremental` runs.

Host tier invariants (besides the radix tree's, over device slots):

    host conservation     free host slots + host slots held by nodes == host pool size
                          (a copy in flight is held by its node from the moment it starts)
    evicted => backed up  a node without device slots has a host copy
    host-only subtrees    below an evicted node every node is evicted (no device slots)
    copies in flight      every node with a write or a load in flight is in the tree and locked
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from memcli.mem_cache.integrity.radix import (
    _child_key_check, _first, _free_slot_check, _lock_check, _page_layout_check, _unique_slot_check,
)
from memcli.mem_cache.integrity.result import CheckResult, failed, passed

if TYPE_CHECKING:
    from memcli.mem_cache.hiradix_cache import HiRadixCache


def hiradix_checks(cache: HiRadixCache) -> list[CheckResult]:
    nodes = list(cache.iter_nodes())
    device = [n for n in nodes if n.value is not None]
    total, evictable, protected = cache._total, cache._evictable, cache._protected
    walked = sum(len(n.key) for n in device)
    walked_evictable = sum(len(n.key) for n in device if n.lock_ref == 0)
    values = cache._cat([n.value for n in device])
    checks = [
        CheckResult("total_size", walked == total, f"device nodes hold {walked} tokens, total counter {total}"),
        CheckResult("evictable_plus_protected", evictable + protected == total,
                    f"evictable {evictable} + protected {protected}, total {total}"),
        CheckResult("evictable_size", walked_evictable == evictable,
                    f"unlocked device nodes hold {walked_evictable} tokens, evictable counter {evictable}"),
        CheckResult("node_count", len(nodes) == cache.num_nodes, f"walked {len(nodes)} nodes, counter {cache.num_nodes}"),
        _lock_check(cache, nodes),
        _shape_check(nodes, cache.page_size),
        _child_key_check(cache, nodes),
        _unique_slot_check(device, values, cache.page_size),
        _free_slot_check(cache, values),
        _queue_check(cache, nodes),
        *host_tier_checks(cache, nodes),
    ]
    if cache.page_size > 1:
        checks.append(_page_layout_check(values, cache.page_size))
    return checks


def _shape_check(nodes: list, page_size: int) -> CheckResult:
    bad = []
    for node in nodes:
        key_len = len(node.key)
        lens = [len(v) for v in (node.value, node.host_value) if v is not None]
        if not lens or any(n != key_len for n in lens) or key_len == 0 or key_len % page_size:
            bad.append(f"node {node.id} key {key_len}, device {_len(node.value)}, host {_len(node.host_value)}")
    return CheckResult("key_value_lengths", not bad, _first(bad, len(nodes), "nodes"))


def _len(value: Any) -> str:
    return "none" if value is None else str(len(value))


def _queue_check(cache: HiRadixCache, nodes: list) -> CheckResult:
    missing = []
    for queue, is_leaf, what in ((cache._queue, cache._device_leaf, "device"),
                                 (cache._host_queue, cache._host_leaf, "host")):
        queued = queue.live_seqs()
        missing += [f"{what} leaf {n.id}" for n in nodes if is_leaf(n) and n.heap_seq not in queued]
    return CheckResult("eviction_queue", not missing, _first(missing, len(nodes), "nodes"))


def host_tier_checks(cache: HiRadixCache, nodes: list | None = None) -> list[CheckResult]:
    """The host-tier invariants of the module docstring. With `nodes` (a full walk) every node
    is checked; without, only the counters and the copies in flight (O(copies in flight))."""
    results = [_host_conservation(cache, nodes), _in_flight(cache)]
    if nodes is not None:
        results += [_evicted_backed_up(nodes), _host_only_subtrees(nodes)]
    return results


def _host_conservation(cache: HiRadixCache, nodes: list | None) -> CheckResult:
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


def _in_flight(cache: HiRadixCache) -> CheckResult:
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


def host_tier_step_check(tree: Any) -> CheckResult:
    """The per-step check (`--check incremental`): host conservation by counters, and copies
    in flight; a failure names the first broken invariant."""
    results = host_tier_checks(tree)
    bad = [r for r in results if not r.ok]
    if bad:
        return failed("host_tier", f"{bad[0].name}: {bad[0].detail}")
    return passed("host_tier", "; ".join(r.detail for r in results))
