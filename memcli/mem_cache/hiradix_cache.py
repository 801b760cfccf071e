"""The hierarchical radix cache: memcli's radix tree with a host-memory tier behind it.

Follows SGLang 0.5.5's `HiRadixCache` (mem_cache/hiradix_cache.py). A node holds its KV on the
device (`value`), in the host pool (`host_value`), or both:

    value set,  host_value None    device only: evicting it deletes it (write_back: copy first)
    value set,  host_value set     backed up: evicting it keeps the node, host copy only
    value None, host_value set     evicted: host only; a match through it may load it back
    (value None, host_value None never happens; the root has both, empty)

Below an evicted node everything is evicted: device eviction takes device leaves (nodes whose
children are all evicted), host eviction takes host leaves (evicted nodes without children).

Writes (device -> host) follow `write_policy`:

    write_through            a node is backed up on its first hit (write threshold 1)
    write_through_selective  on its second (threshold 2)
    write_back               only when it is evicted from the device (a blocking copy)

Hits are counted in `insert` (as SGLang does: a request's prefix passes through its nodes when
the request is cached), never for a non-final chunk (`chunked`) and never under write_back.
A node is locked while its backup is in flight; `check_hicache_events` unlocks it once the
copy is done (`CacheController.finished_writes`).

A match may end in evicted nodes: `match_prefix` reports them as `host_hit_length` tokens
after the device prefix. `init_load_back` loads the whole host-only part back in one
transfer, or none of it when it is shorter than `load_back_threshold` tokens or over the
memory quota; it evicts device memory to make room, and the loaded nodes stay locked until
the load is acknowledged.

Sizes (`total_size`, `evictable_size`, `protected_size`) count device tokens only;
`host_size` counts the host copies the tree holds.

SGLang 0.5.23 (HiCache on `UnifiedRadixCache`) differs by options the stack sets from the
semantics keys: the unified tree's stamps, split and `insert_unified` walk (a host-only node on
the path takes the request's slots; one hit per request per node, past `cache_inserted_len`,
chunks included), the prompt split and row-order frees (the radix cache's unified options);
`shortfall_first` (a copy short of room evicts the shortfall first, and a backup fails when
the host cannot free it); `demote_per_node` (write_back frees each victim right after its
copy); `reclaim_duplicates` (write_back host pressure frees the host copies of nodes also on
the device first, oldest first).
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any, Iterator, Optional

import numpy as np
import torch

from memcli.check_result import IntegrityReport
from memcli.errors import IntegrityError
from memcli.mem_cache.base_prefix_cache import MatchResult, RadixKey
from memcli.mem_cache.cache_controller import CacheController
from memcli.mem_cache.eviction import EvictionQueue
from memcli.mem_cache.radix_cache import EvictionRecord, RadixCache, TreeNode
from memcli.mem_cache.tree_checks import hiradix_checks, host_tier_checks

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class HiTreeNode(TreeNode):
    """A radix node that may also hold (or only hold) a host copy of its KV."""

    __slots__ = ("host_value", "host_ref", "load_pending")

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.host_value: Optional[torch.Tensor] = None  # host slots, None when not backed up
        self.host_ref = 0  # readers of the host copy (a load-back in progress): not host-evictable
        self.load_pending: Optional[int] = None  # the load-back (its anchor's id) filling it, until acknowledged

    @property
    def backuped(self) -> bool:
        return self.host_value is not None


class HostTierCounters:
    """A live view of a hierarchical cache's host tier, for step records and reports."""

    def __init__(self, cache: "HiRadixCache"):
        self._cache = cache

    @property
    def used(self) -> int:
        return self._cache.host_size()

    @property
    def size(self) -> int:
        return self._cache.host_pool.size

    @property
    def d2h_bytes(self) -> int:
        return self._cache.controller.stats.d2h_bytes

    @property
    def h2d_bytes(self) -> int:
        return self._cache.controller.stats.h2d_bytes

    def record_load_wait(self, wait_ms: float) -> None:
        """A prefill batch waited `wait_ms` past its compute for its load-backs."""
        self._cache.controller.stats.load_wait_ms += wait_ms

    def summary(self) -> dict:
        """Totals: transfers (bytes, copies, busy and wait time) and the tree's host events."""
        c, stats = self._cache, self._cache.controller.stats
        return {
            "host_pool_tokens": c.host_pool.size, "host_used_tokens": c.host_size(),
            "write_policy": c.write_policy, "load_back_threshold": c.load_back_threshold,
            "d2h_bytes": stats.d2h_bytes, "h2d_bytes": stats.h2d_bytes,
            "d2h_copies": stats.d2h_copies, "h2d_copies": stats.h2d_copies,
            "d2h_busy_ms": stats.d2h_busy_ms, "h2d_busy_ms": stats.h2d_busy_ms,
            "write_back_stall_ms": stats.stall_ms, "load_wait_ms": stats.load_wait_ms,
            "backed_up_tokens": c.backed_up_tokens, "loaded_back_tokens": c.loaded_back_tokens,
            "write_backs": c.written_back_nodes, "host_evicted_tokens": c.host_evicted_tokens,
            "dropped_tokens": c.dropped_tokens,
        }


class HiRadixCache(RadixCache):
    """See the module docstring. `host_pool` is a `HostKVPool` that must have the allocator's
    page size (a larger one cannot take a node's pages: its `alloc` raises; `check-page-size
    --inject host_pool.page_size=N` shows it); `controller` moves data between the pools (a
    synchronous one is built when None).

    `host_floor="above_device"` (SGLang) relies on the host pool being larger than the device
    pool: a write-back then always finds room. With `"any"` a node that finds no host room is
    deleted (with any host-only nodes below it) instead.
    """

    def __init__(self, req_to_token_pool: Any, allocator: Any, page_size: int, host_pool: Any,
                 write_policy: str = "write_through", load_back_threshold: int = 10,
                 controller: Optional[CacheController] = None, host_floor: str = "above_device",
                 eviction_policy: str = "lru", device: Optional[torch.device | str] = None,
                 lru_clock: str = "simulated", split_stamp: str = "keep", retract_free: str = "one_call",
                 shortfall_first: bool = False, demote_per_node: bool = False,
                 reclaim_duplicates: bool = False, **unified: Any):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}; valid: {', '.join(WRITE_POLICIES)}")
        if host_floor not in ("above_device", "any"):
            raise ValueError(f"host_floor {host_floor!r}: use above_device or any")
        self.host_pool = host_pool
        self.write_policy = write_policy
        self.write_threshold = 1 if write_policy == "write_through" else 2
        self.load_back_threshold = load_back_threshold
        self.drop_without_room = host_floor == "any"
        self.evict_shortfall_first = shortfall_first  # 0.5.23: a copy short of room evicts the shortfall
        self.demote_per_node = demote_per_node  # 0.5.23: a written-back node frees its slots at once
        # 0.5.23 under write_back: nodes on both tiers, in the order they became so (entries
        # may be stale: checked when reclaimed)
        self.reclaim_duplicates = reclaim_duplicates and write_policy == "write_back"
        self._duplicates: dict[int, HiTreeNode] = {}
        self._writing_back: set = set()  # device leaves being written back inside one evict call
        self.ongoing_write: dict[int, HiTreeNode] = {}
        self.ongoing_load: dict[int, HiTreeNode] = {}
        self.host_evicted_tokens = 0  # host copies freed by host eviction (never reset)
        self.written_back_nodes = 0  # nodes written to host on device eviction (write_back)
        self.backed_up_tokens = 0  # tokens of every backup started
        self.loaded_back_tokens = 0  # tokens of every load-back started
        self.dropped_tokens = 0  # device tokens deleted for want of host room (host_floor any)
        self._host_total = 0  # host slots held by nodes of the tree (in flight included)
        super().__init__(req_to_token_pool, allocator, page_size, eviction_policy=eviction_policy,
                         kv_events=False, device=device, lru_clock=lru_clock, split_stamp=split_stamp,
                         count_hits=False, retract_free=retract_free, **unified)
        self.controller = controller or CacheController(allocator, host_pool, write_policy,
                                                        host_pool.bytes_per_token, math.inf, 0.0)
        # Copies are timed in milliseconds on `clock` (replays set it to the simulated clock).
        self.clock = lambda: time.monotonic() * 1e3
        self.controller.now = lambda: self.clock()
        self._counters = HostTierCounters(self)

    # -- tree scaffolding -----------------------------------------------------------------

    def _node(self, parent, key, value, extra_key, birth) -> HiTreeNode:
        last_access = self._stamp()
        return HiTreeNode(parent, key, value, extra_key, last_access, self._stamp(), birth)

    def _new_tree(self) -> None:
        super()._new_tree()
        self.root.host_value = torch.empty((0,), dtype=torch.int64)
        seq = itertools.count()
        self._queue = EvictionQueue(self.priority, self._device_leaf, seq)
        self._host_queue = EvictionQueue(self.priority, self._host_leaf, seq)
        self._host_total = 0

    def reset(self) -> None:
        """Empty tree, empty host pool, no copy in flight. Device slots are not returned."""
        self.ongoing_write.clear()
        self.ongoing_load.clear()
        if hasattr(self, "controller"):
            self.controller.reset()
        self.host_pool.clear()
        super().reset()

    def _device_leaf(self, node: HiTreeNode) -> bool:
        """An evictable device leaf: in the tree, on the device, unlocked, every child evicted
        (or being written back in this evict call)."""
        pending = self._writing_back
        if node.parent is None or node.value is None or node.lock_ref or node in pending:
            return False
        return all(child.value is None or child in pending for child in node.children.values())

    @staticmethod
    def _host_leaf(node: HiTreeNode) -> bool:
        """An evictable host leaf: in the tree, evicted, no children, its copy not being read."""
        return node.parent is not None and node.value is None and not node.children and node.host_ref == 0

    def _touched(self, node: HiTreeNode) -> None:
        if self._device_leaf(node):
            self._queue.push(node)
        elif self._host_leaf(node):
            self._host_queue.push(node)
        else:
            return
        if len(self._queue) + len(self._host_queue) > 4 * self._num_nodes + 1024:
            nodes = list(self._iter_nodes())
            self._queue.rebuild(n for n in nodes if self._device_leaf(n))
            self._host_queue.rebuild(n for n in nodes if self._host_leaf(n))

    def _split(self, child: HiTreeNode, split_len: int, fresh: Optional[bool] = None) -> HiTreeNode:
        """Insert a node holding `child`'s first `split_len` tokens above it (device and host
        parts alike); it takes the lock count and the hit count. Sizes do not change."""
        parent = child.parent
        if self.refresh_split if fresh is None else fresh:
            upper = self._node(parent, child.key[:split_len], None, child.extra_key, self._now)
        else:
            upper = HiTreeNode(parent, child.key[:split_len], None, child.extra_key,
                               child.last_access_time, child.creation_time, child.birth_time)
        upper.hit_count = child.hit_count
        upper.lock_ref = child.lock_ref
        if child.value is not None:
            upper.value, child.value = child.value[:split_len], child.value[split_len:]
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:split_len], child.host_value[split_len:]
        parent.children[self._child_key(child.extra_key, child.key, 0)] = upper
        child.key, child.parent = child.key[split_len:], upper
        upper.children[self._child_key(child.extra_key, child.key, 0)] = child
        self._num_nodes += 1
        upper.load_pending = child.load_pending
        self._track_duplicate(upper)
        return upper

    def _track_duplicate(self, node: HiTreeNode) -> None:
        """0.5.23's `_update_duplicate_tracking`: a node on both tiers, no load-back pending."""
        if not self.reclaim_duplicates:
            return
        if node.value is not None and node.host_value is not None and node.load_pending is None:
            self._duplicates.setdefault(node.id, node)
        else:
            self._duplicates.pop(node.id, None)

    def _reclaim_duplicates(self, num_tokens: int) -> int:
        """0.5.23's `_reclaim_full_host_duplicates`: free host copies of nodes also on the
        device until `num_tokens` are freed; a first pass spares evictable device leaves."""
        freed, swept = 0, []
        for spare_leaves in (True, False):
            for node_id, node in self._duplicates.items():
                if freed >= num_tokens:
                    break
                if node.value is None or node.host_value is None or node.parent is None:
                    swept.append(node_id)
                    continue
                if spare_leaves and self._device_leaf(node):
                    continue
                if node.load_pending is not None or node.host_ref > 0 or node.id in self.ongoing_write:
                    continue
                freed += self.controller.evict_host(node.host_value)
                self._host_total -= len(node.host_value)
                node.host_value = None
                swept.append(node_id)
            if freed >= num_tokens:
                break
        for node_id in swept:
            self._duplicates.pop(node_id, None)
        return freed

    def _walk(self, tokens: np.ndarray, extra_key: Optional[str], count_hit: bool, on_path: int = 0):
        """The radix walk (stamps, splits); the values returned are the device ones only."""
        node, pos, values = super()._walk(tokens, extra_key, False, on_path)
        return node, pos, [v for v in values if v is not None]

    # -- sizes ----------------------------------------------------------------------------

    def host_size(self) -> int:
        """Host slots the tree's nodes hold (copies in flight included)."""
        return self._host_total

    # -- match and insert -------------------------------------------------------------------

    def touch_prefix(self, key: RadixKey) -> None:
        """This tree's own match (both tiers), its result dropped: not the device-only walk of
        `RadixCache.touch_prefix`."""
        self.match_prefix(key)

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached page-aligned prefix of `key` on either tier. `device_indices` and
        `last_node` cover the device part; `host_hit_length` tokens follow on the host only,
        ending at `last_host_node`. Counts no hit (see `insert`)."""
        aligned = len(key) - len(key) % self.page_size
        if self.disable or aligned == 0:
            return MatchResult(self.empty_indices(), self.root, self.root, 0)
        self._begin()
        if self.unified:  # 0.5.23: no stamps on the way down, the best match's path at the end
            node, _, values = self._walk_unified(key.token_ids[:aligned], key.extra_key)
            values = [v for v in values if v is not None]
            self._stamp_path(node)
        else:
            node, _, values = self._walk(key.token_ids[:aligned], key.extra_key, count_hit=False)
        self._touched(node)
        last, host_hit = node, 0
        while last.value is None:
            host_hit += len(last.host_value)
            last = last.parent
        last_host = node
        while last_host.host_value is None:
            last_host = last_host.parent
        return MatchResult(self._cat(values), last, last_host, host_hit)

    def insert(self, key: RadixKey, value: Optional[torch.Tensor] = None, chunked: bool = False,
               on_path: int = 0) -> int:
        """Cache `value` for `key`; returns the leading tokens already on the device (the
        caller frees those duplicates). Evicted nodes on the path take their slots from
        `value` again (recomputed KV). Counts a hit on every device node passed and on the
        new leaf, which may start backups (see the module docstring). `on_path`: as
        `RadixCache._walk`'s (a node ending inside it is matched without a compare)."""
        prepared = self._insert_input(key, value)
        if prepared is None:
            return 0
        tokens, value, aligned = prepared
        if value.dtype != torch.int64 or value.device != self.device:
            value = value.to(self.device, torch.int64)
        now = self._begin()
        node, pos, device_prefix = self.root, 0, 0
        while pos < aligned:
            child = node.children.get(self._child_key(key.extra_key, tokens, pos))
            if child is None:
                break
            child_len = len(child.key)
            matched = self._matched(child.key, tokens, pos, on_path)
            if matched < child_len and not self.refresh_split:
                child = self._split(child, matched)
                child.last_access_time = self._stamp()
            else:
                child.last_access_time = self._stamp()
                if matched < child_len:
                    child = self._split(child, matched)
            if child.value is None:
                child.value = value[pos: pos + matched].clone()  # recomputed KV revives the node
                self._total += matched
                self._evictable += matched
                self._track_duplicate(child)
            else:
                self._inc_hit_count(child, chunked)
                device_prefix += matched
            node, pos = child, pos + matched
            if matched < child_len:
                break
        if pos < aligned:
            leaf_key, leaf_value = tokens[pos:aligned], value[pos:aligned]
            if 2 * (aligned - pos) < len(tokens):
                leaf_key, leaf_value = leaf_key.copy(), leaf_value.clone()
            node = self._add_leaf(node, leaf_key, leaf_value, key.extra_key, now)
            if self.write_policy != "write_back":
                self._inc_hit_count(node, chunked)
        self._touched(node)
        return device_prefix

    def _insert_walked(self, child: HiTreeNode, slots: Any, pos: int, matched: int,
                       prev_prefix_len: int, owner: Any) -> None:
        """0.5.23's insert walk on the host tier (`RadixCache.insert_unified`): a node on the
        path with only a host copy takes the request's slots (`_unevict_node_on_insert`); one
        on the device frees the request's duplicates as without a host tier."""
        if child.value is not None:
            super()._insert_walked(child, slots, pos, matched, prev_prefix_len, owner)
            return
        child.value = slots.get(pos, pos + matched).to(self.device, torch.int64).clone()
        self._total += matched
        self._evictable += matched
        self._track_duplicate(child)

    def _count_insert_hit(self, node: HiTreeNode) -> None:
        """0.5.23's `_inc_hit_count_and_check` (none under write_back): reaching the write
        threshold without a host copy starts the node's backup."""
        if self.write_policy == "write_back":
            return
        node.hit_count += 1
        if node.host_value is None and node.hit_count >= self.write_threshold:
            self.write_backup(node)

    def _inc_hit_count(self, node: HiTreeNode, chunked: bool) -> None:
        if self.write_policy == "write_back" or chunked:
            return
        node.hit_count += 1
        if node.host_value is None and node.hit_count >= self.write_threshold:
            self.write_backup(node)

    # -- device -> host -----------------------------------------------------------------------

    def write_backup(self, node: HiTreeNode, write_back: bool = False) -> int:
        """Start copying `node` to the host; returns its tokens, or 0 when the host pool has no
        room even after host eviction. Locks the node until the copy is acknowledged (not for
        a write-back, which the evicting call waits for)."""
        short = len(node.value) - self.host_pool.available_size()
        if self.evict_shortfall_first and short > 0 and self.evict_host(short) < short:
            return 0
        host_indices = self.controller.write(node.value, node.id)
        if host_indices is None and not self.evict_shortfall_first:
            self.evict_host(len(node.value))
            host_indices = self.controller.write(node.value, node.id)
        if host_indices is None:
            return 0
        node.host_value = host_indices
        self._host_total += len(host_indices)
        self.backed_up_tokens += len(host_indices)
        self.ongoing_write[node.id] = node
        if not write_back:
            self.inc_lock_ref(node)
        return len(host_indices)

    def writing_check(self, write_back: bool = False) -> None:
        """Acknowledge finished writes (unlocking their nodes); with `write_back`, wait for all."""
        if write_back:
            for node_id in self.controller.wait_writes():
                del self.ongoing_write[node_id]
            return
        if not self.ongoing_write:
            return
        for node_id in self.controller.finished_writes():
            self.dec_lock_ref(self.ongoing_write.pop(node_id))

    def loading_check(self) -> None:
        for node_id in self.controller.finished_loads():
            self._finish_load(node_id)

    def _finish_load(self, node_id: int) -> None:
        """A load-back is acknowledged: its anchor is unlocked, its nodes are settled."""
        anchor = self.ongoing_load.pop(node_id)
        self.dec_lock_ref(anchor)
        node = anchor
        while node is not self.root and node is not None:  # 0.5.23's finish_load_back
            if node.load_pending == node_id:
                node.load_pending = None
                self._track_duplicate(node)
            node = node.parent

    def check_hicache_events(self) -> None:
        """Acknowledge the copies that are done: their nodes are unlocked."""
        self.writing_check()
        self.loading_check()

    # -- eviction -----------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free device tokens, lowest priority device leaf first, until `num_tokens` are freed.

        A backed-up leaf keeps its node (host copy only); another is deleted, or under
        write_back copied to the host first (all such copies are waited for at the end, then
        their device slots freed). Returns the device tokens freed (or being freed)."""
        if self.disable or num_tokens <= 0:
            return 0
        now = self._begin()
        freed = 0
        write_back = self.write_policy == "write_back"
        pending: list[HiTreeNode] = []
        while freed < num_tokens:
            node = self._queue.pop()
            if node is None:
                break
            parent = node.parent
            if node.host_value is not None:
                freed += self._evict_backuped(node, now)
            elif write_back and self.write_backup(node, write_back=True) and self.demote_per_node:
                self.writing_check(write_back=True)
                self.written_back_nodes += 1
                freed += self._evict_backuped(node, now)
            elif write_back and node.host_value is not None:  # written back, freed after the walk
                freed += len(node.value)
                pending.append(node)
                self._writing_back.add(node)
                self.written_back_nodes += 1
            elif any(child in self._writing_back for child in node.children.values()):
                continue  # no host room for it, and a child is still being written: keep it
            else:
                freed += self._evict_regular(node, now)
            self._touched(parent)
        if write_back:
            self.writing_check(write_back=True)
            self._writing_back.clear()
            for node in pending:
                self._evict_backuped(node, now)
            for node in pending:
                self._touched(node.parent)
        self.evicted_tokens_total += freed
        return freed

    def _evict_backuped(self, node: HiTreeNode, now: float) -> int:
        """The node keeps its host copy and gives up its device slots."""
        size = self.controller.evict_device(node.value, **self._segment)
        self._total -= size
        self._evictable -= size
        self.eviction_log.append(EvictionRecord(size, now - node.birth_time, node.hit_count))
        node.value = None
        self._touched(node)
        return size

    def _evict_regular(self, node: HiTreeNode, now: float) -> int:
        """Delete a device leaf without a host copy (and, only reachable when the host pool may
        be too small, the host-only nodes below it)."""
        for child in list(node.children.values()):
            self._delete_host_subtree(child)
        if node.host_value is not None:  # pragma: no cover - callers pass leaves without a copy
            raise IntegrityError(f"node {node.id}: regular eviction of a backed-up node")
        size = len(node.key)
        if self.drop_without_room and self.write_policy == "write_back":
            self.dropped_tokens += size
        return self._delete_leaf(node, now)

    def _delete_host_subtree(self, node: HiTreeNode) -> None:
        for child in list(node.children.values()):
            self._delete_host_subtree(child)
        self.host_evicted_tokens += self.controller.evict_host(node.host_value)
        self._host_total -= len(node.host_value)
        del node.parent.children[self._child_key(node.extra_key, node.key, 0)]
        self._num_nodes -= 1
        node.parent = None

    def evict_host(self, num_tokens: int) -> int:
        """Free host copies of host-only leaves, lowest priority first, until `num_tokens` are
        freed; their nodes leave the tree. Returns the host slots freed."""
        freed = self._reclaim_duplicates(num_tokens) if self.reclaim_duplicates else 0
        while freed < num_tokens:
            node = self._host_queue.pop()
            if node is None:
                break
            parent = node.parent
            freed += self.controller.evict_host(node.host_value)
            self._host_total -= len(node.host_value)
            del parent.children[self._child_key(node.extra_key, node.key, 0)]
            self._num_nodes -= 1
            node.parent = None
            if parent is not self.root:
                self._touched(parent)
        self.host_evicted_tokens += freed
        return freed

    # -- host -> device -----------------------------------------------------------------------

    def load_back(self, node: HiTreeNode, mem_quota: Optional[int] = None) -> Optional[torch.Tensor]:
        """Load the evicted nodes from `node` up to the device prefix back, all or none; the
        new device slots, or None (too short, over `mem_quota`, or no device room)."""
        last_hit = node
        nodes_to_load: list[HiTreeNode] = []
        while node.value is None:
            nodes_to_load.append(node)
            node = node.parent
        nodes_to_load.reverse()
        ancestor = node
        delta = self.inc_lock_ref(ancestor)
        host_indices = torch.cat([n.host_value for n in nodes_to_load])
        if len(host_indices) < self.load_back_threshold or (
                mem_quota is not None and len(host_indices) > mem_quota + delta):
            self.dec_lock_ref(ancestor)
            return None
        for n in nodes_to_load:  # eviction below may evict host copies: not these
            n.host_ref += 1
        short = len(host_indices) - self.allocator.available_size()
        if self.evict_shortfall_first and short > 0:
            self.evict(short)
        device_indices = self.controller.load(host_indices, last_hit.id)
        if device_indices is None and not self.evict_shortfall_first:
            self.evict(len(host_indices))
            device_indices = self.controller.load(host_indices, last_hit.id)
        for n in nodes_to_load:
            n.host_ref -= 1
        self.dec_lock_ref(ancestor)
        if device_indices is None:
            return None
        self.ongoing_load[last_hit.id] = last_hit
        offset = 0
        for n in nodes_to_load:
            n.value = device_indices[offset: offset + len(n.host_value)]
            offset += len(n.host_value)
            n.load_pending = last_hit.id
        self._total += len(device_indices)
        self._evictable += len(device_indices)
        self.loaded_back_tokens += len(device_indices)
        self.inc_lock_ref(last_hit)
        return device_indices

    def init_load_back(self, last_host_node: HiTreeNode, host_hit_length: int,
                       mem_quota: Optional[int] = None) -> tuple[torch.Tensor, HiTreeNode]:
        """See `BasePrefixCache.init_load_back`. `host_hit_length` is not read (as in SGLang)."""
        last_node = last_host_node
        if last_node.value is None:
            loaded = self.load_back(last_node, mem_quota)
            if loaded is not None:
                return loaded, last_node
            while last_node.value is None:
                last_node = last_node.parent
        return self.empty_indices(), last_node

    def ready_to_load_host_cache(self) -> Optional[float]:
        return self.controller.start_loading()

    def copy_protected_size(self) -> int:
        """Device tokens on the paths that copies in flight lock (write-through backups and
        load-backs)."""
        seen, total = set(), 0
        holders = list(self.ongoing_load.values())
        if self.write_policy != "write_back":
            holders += self.ongoing_write.values()
        for node in holders:
            while node is not self.root and node.id not in seen:
                seen.add(node.id)
                total += len(node.key)
                node = node.parent
        return total

    def next_copy_end(self) -> Optional[float]:
        return self.controller.next_end_ms()

    def finish_copies(self) -> None:
        """Acknowledge every copy, done or not (the caller waited for them)."""
        self.controller.start_loading()
        for node_id in self.controller.wait_writes(stall=False):
            node = self.ongoing_write.pop(node_id)
            if self.write_policy != "write_back":
                self.dec_lock_ref(node)
        for ack in list(self.controller.ack_load_queue):
            for node_id in ack.node_ids:
                self._finish_load(node_id)
        self.controller.ack_load_queue.clear()

    def host_tier(self) -> HostTierCounters:
        return self._counters

    def pending_transfer_stall_ms(self) -> float:
        return self.controller.pending_stall_ms

    def take_transfer_stall_ms(self) -> float:
        return self.controller.take_stall_ms()

    # -- inspection -----------------------------------------------------------------------------

    def all_values_flatten(self) -> torch.Tensor:
        """Every device slot the tree owns."""
        return self._cat([node.value for node in self._iter_nodes() if node.value is not None])

    def all_host_values(self) -> torch.Tensor:
        """Every host slot the tree's nodes hold."""
        values = [node.host_value for node in self._iter_nodes() if node.host_value is not None]
        return torch.cat(values) if values else torch.empty((0,), dtype=torch.int64)

    def iter_nodes(self) -> Iterator[HiTreeNode]:
        return self._iter_nodes()

    def host_tier_checks(self) -> list:
        """The host-tier invariants that need no walk of the tree: host conservation by
        counters, copies in flight locked (O(copies in flight); `tree_checks.host_tier_checks`)."""
        return host_tier_checks(self)

    def _view_queues(self) -> tuple:
        return (("device", self._queue), ("host", self._host_queue))

    def check_integrity(self) -> IntegrityReport:
        """Walk the tree: device sizes, locks, shapes, slots, both eviction queues, and the host
        tier (host pool conservation, evicted nodes backed up, nothing on the device below an
        evicted node, copies in flight locked)."""
        return IntegrityReport("hiradix cache", hiradix_checks(self.view(), self))
