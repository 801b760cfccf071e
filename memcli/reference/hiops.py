"""Operation-level differential harness for the host tier: SGLang's real `HiRadixCache` (with
its real allocator and host pool, and a synchronous cache controller whose copies are done
at once) against memcli's `HiRadixCache` with a synchronous `CacheController`.

Operations (`Op.kind`, `Op.arg`), on top of `memcli.reference.ops`:

    insert   tokens   alloc len(tokens) slots, insert(key, slots), free the duplicate prefix
    chunk    tokens   the same with chunked=True (a non-final prefill chunk: no hit counted)
    match    tokens   match_prefix(key); its device node and host node become handle <op index>
    load     handle   init_load_back(host node of that match, its host hit length); the new
                      device node replaces the handle's device node (unless it is locked)
    lock     handle   inc_lock_ref(device node of that match)
    unlock   handle   dec_lock_ref(device node of that match)
    evict    tokens   evict(tokens) (device; backs up or deletes)
    reserve  tokens   evict(tokens) only when fewer than `tokens` slots are free (as admission does)
    evict_host tokens evict_host(tokens)
    events   -        ready_to_load_host_cache(), then check_hicache_events()

An operation SGLang cannot take in its current state (an insert that does not fit, a lock of
an evicted or deleted node, an unlock without lock, a load through a deleted node) is skipped
on both sides. After every operation both sides are compared: the result, the tree (keys,
device slots, host slots, lock counts; ids compared as int64 bytes), the device free list, the
host free list and the sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from memcli.config import SemanticsConfig
from memcli.mem_cache.allocator import make_allocator
from memcli.mem_cache.base_prefix_cache import RadixKey as MemcliKey
from memcli.mem_cache.cache_controller import CacheController
from memcli.mem_cache.clock import LogicalClock
from memcli.mem_cache.hiradix_cache import HiRadixCache as MemcliHiRadix
from memcli.mem_cache.host_pool import HostKVPool
from memcli.mem_cache.pages import align_down, num_pages, whole_pages
from memcli.reference.loader import Reference, load_reference
from memcli.reference.ops import Divergence, Op, _compare, _in_tree, record_frees
from memcli.stack import UNIFIED_TREE_OPTIONS, radix_semantics

OBSERVED = ("result", "tree", "free_list", "host_free_list", "sizes")
KINDS = ("insert", "chunk", "match", "load", "lock", "unlock", "evict", "reserve", "evict_host", "events")


@dataclass
class _Side:
    tree: Any
    allocator: Any
    host_free: Any  # () -> list of free host slots in allocation order
    make_key: Any
    root: Any
    freed: list = field(default_factory=list)
    handles: dict = field(default_factory=dict)  # op index -> [device node, host node, host hit length]
    locks: dict = field(default_factory=dict)  # op index -> locks held through that match (both sides)

    def record_frees(self) -> None:
        record_frees(self.allocator, self.freed)

    def observe(self) -> dict:
        tree = self.tree
        return {"tree": _shape(self.root), "free_list": self.free_list(), "host_free_list": self.host_free(),
                "sizes": (self.allocator.available_size(), tree.evictable_size(), tree.protected_size(),
                          int(tree.total_size()))}

    def free_list(self) -> list[int]:
        if hasattr(self.allocator, "free_page_ids"):
            return self.allocator.free_page_ids().tolist()
        return torch.cat([self.allocator.free_pages, self.allocator.release_pages]).tolist()


def _bytes(values: Any) -> Optional[bytes]:
    """Ids as int64 bytes (cheap to build and compare on large pools)."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        values = values.cpu().numpy()
    return np.asarray(values, dtype=np.int64).tobytes()


def _key_bytes(node: Any) -> bytes:
    key = node.key
    return _bytes(key.token_ids if hasattr(key, "token_ids") else key)


def _shape(node: Any) -> list:
    """Canonical tree: [(key, device slots, host slots, lock_ref, children)] sorted by key, ids
    as int64 bytes."""
    return sorted((_key_bytes(c), _bytes(c.value), _bytes(c.host_value), c.lock_ref, _shape(c))
                  for c in node.children.values())


def _sglang_side(ref: Reference, size: int, page_size: int, policy: str, write_policy: str, ratio: float) -> _Side:
    kv_pool = ref.tiny_kv_pool(size, page_size)
    if page_size == 1:
        allocator = ref.TokenToKVPoolAllocator(size, torch.int64, ref.device, kv_pool, False)
    else:
        allocator = ref.PagedTokenToKVPoolAllocator(size, page_size, torch.int64, ref.device, kv_pool, False)
    tree = ref.hiradix_cache.HiRadixCache(None, allocator, None, page_size, ratio, 0, write_policy, "kernel",
                                          "layer_first", False, eviction_policy=policy)
    host = tree.token_to_kv_pool_host
    side = _Side(tree, allocator, lambda: _bytes(host.free_slots), lambda t: ref.RadixKey(list(t)), tree.root_node)
    side.record_frees()
    return side


def _memcli_side(size: int, page_size: int, policy: str, write_policy: str, ratio: float,
                 profile: SemanticsConfig) -> _Side:
    allocator = make_allocator(size, page_size, torch.device("cpu"), "torch")
    host_size = align_down(int(size * ratio), page_size)
    host_pool = HostKVPool(host_size, page_size, 1, 1, 1, "float32")
    behaviour = profile.resolved()
    semantics = radix_semantics(behaviour)
    for key in ("count_hits", *UNIFIED_TREE_OPTIONS):  # the host tier runs on 0.5.5's tree
        semantics.pop(key)
    controller = CacheController(allocator, host_pool, write_policy, host_pool.bytes_per_token, math.inf, 0.0)
    tree = MemcliHiRadix(None, allocator, page_size, host_pool, write_policy=write_policy, load_back_threshold=10,
                         controller=controller, host_floor=behaviour.host_pool_floor, eviction_policy=policy,
                         **semantics)
    tree.clock = LogicalClock()
    side = _Side(tree, allocator, lambda: _bytes(host_pool.free_slot_ids()), lambda t: MemcliKey(list(t)), tree.root)
    side.record_frees()
    return side


def _skip_reason(op: Op, ref_side: _Side, locks: dict[int, int]) -> Optional[str]:
    if op.kind in ("insert", "chunk") and ref_side.allocator.available_size() < len(op.arg):
        return "skipped: no room"
    if op.kind in ("lock", "unlock", "load"):
        handle = ref_side.handles.get(op.arg)
        if handle is None:
            return "skipped: no such match"
        node = handle[1] if op.kind == "load" else handle[0]
        if not _in_tree(node, ref_side.root):
            return "skipped: node left the tree"
        if op.kind == "lock" and node.value is None:
            return "skipped: evicted"
        if op.kind == "unlock" and locks.get(op.arg, 0) == 0:
            return "skipped: not locked"
        if op.kind == "load" and handle[2] == 0:
            return "skipped: no host hit"
    return None


def _apply(side: _Side, index: int, op: Op) -> Any:
    tree = side.tree
    if op.kind in ("insert", "chunk"):
        value = side.allocator.alloc(len(op.arg))
        if value is None:
            return "alloc returned None"
        prefix_len = tree.insert(side.make_key(op.arg), value.clone(), chunked=op.kind == "chunk")
        side.allocator.free(value[:prefix_len])
        return ("prefix_len", int(prefix_len), "slots", value.tolist())
    if op.kind == "match":
        result = tree.match_prefix(side.make_key(op.arg))
        side.handles[index] = [result[1], result[2], int(result[3])]
        return ("device", result[0].tolist(), "host_hit", int(result[3]))
    if op.kind == "load":
        handle = side.handles[op.arg]
        loaded, node = tree.init_load_back(handle[1], handle[2])
        if not side.locks.get(op.arg):  # later locks of this match take the loaded node
            handle[0] = node
        return ("loaded", loaded.tolist())
    if op.kind == "lock":
        return ("delta", tree.inc_lock_ref(side.handles[op.arg][0]))
    if op.kind == "unlock":
        return ("delta", tree.dec_lock_ref(side.handles[op.arg][0]))
    if op.kind == "evict":
        side.freed.clear()
        tree.evict(op.arg)
        return ("freed", list(side.freed))
    if op.kind == "reserve":
        side.freed.clear()
        if side.allocator.available_size() < op.arg:
            tree.evict(op.arg)
        return ("freed", list(side.freed))
    if op.kind == "evict_host":
        tree.evict_host(op.arg)
        return "done"
    if op.kind == "events":
        tree.ready_to_load_host_cache()
        tree.check_hicache_events()
        return "done"
    raise ValueError(f"unknown op kind {op.kind!r}")


def run_hi_ops(ops: list[Op], page_size: int, policy: str = "lru", write_policy: str = "write_through",
               size: Optional[int] = None, ratio: float = 2.0, ref: Optional[Reference] = None,
               fields: tuple[str, ...] = OBSERVED, profile: str | SemanticsConfig = "sglang-0.5.5",
               check_after: tuple[str, ...] = KINDS) -> Optional[Divergence]:
    """Apply `ops` to both hierarchical caches (device pools of `size` tokens, default 16
    pages; host pools `ratio` times larger); the first divergence in `fields`, or None. After
    each op of a kind in `check_after`, memcli's cache also walks its own integrity checks."""
    ref = ref or load_reference()
    size = size or 16 * page_size
    if isinstance(profile, str):
        profile = SemanticsConfig(profile=profile)
    ref.use_clock(LogicalClock())
    try:
        sgl = _sglang_side(ref, size, page_size, policy, write_policy, ratio)
        mem = _memcli_side(size, page_size, policy, write_policy, ratio, profile)
        locks: dict[int, int] = {}
        sgl.locks = mem.locks = locks
        for index, op in enumerate(ops):
            skip = _skip_reason(op, sgl, locks)
            ref_result = skip or _apply(sgl, index, op)
            mem_result = skip or _apply(mem, index, op)
            if not skip and op.kind in ("lock", "unlock"):
                locks[op.arg] = locks.get(op.arg, 0) + (1 if op.kind == "lock" else -1)
            found = _compare(index, op, {"result": ref_result, **sgl.observe()},
                             {"result": mem_result, **mem.observe()}, fields)
            if found is not None:
                return found
            report = mem.tree.check_integrity() if op.kind in check_after else None
            if report is not None and not report.ok:
                return Divergence(index, op, "memcli integrity", None, [c.detail for c in report.failures])
        return None
    finally:
        ref.restore_clock()


def ops_from_trace(requests: list, page_size: int, max_tokens: int, events_every: int = 1) -> list[Op]:
    """The cache operations a simple serving loop issues for `requests` (token lists), one
    request at a time: match, load back a host hit, lock, evict room for the new tokens,
    insert (as `cache_finished_req` does), unlock, and every `events_every` requests the
    acknowledgements. Requests are cut to `max_tokens` tokens."""
    ops: list[Op] = []
    for i, tokens in enumerate(requests):
        tokens = tuple(int(t) for t in tokens[:max_tokens])
        tokens = tokens[: align_down(len(tokens), page_size)]
        if not tokens:
            continue
        match = len(ops)
        ops += [Op("match", tokens), Op("load", match), Op("lock", match), Op("reserve", len(tokens)),
                Op("insert", tokens), Op("unlock", match)]
        if (i + 1) % events_every == 0:
            ops.append(Op("events", None))
    return ops



WEIGHTS = {"insert": 5, "chunk": 1, "match": 4, "load": 3, "lock": 2, "unlock": 2, "evict": 2, "evict_host": 1,
           "events": 2}


def random_tokens(rng: Any, page_size: int, known: list[tuple[int, ...]], block: int) -> tuple[int, ...]:
    """1 to 6 blocks of `block` pages, each block one of three contents; 70 % of the time it
    extends a prefix of a known key (so that keys share, split and diverge)."""
    blocks = [tuple([rng.randint(0, 2)] + [7] * (block * page_size - 1)) for _ in range(rng.randint(1, 6))]
    tokens = tuple(t for b in blocks for t in b)
    if known and rng.random() < 0.7:
        base = rng.choice(known)
        cut = rng.randint(1, whole_pages(len(base), page_size)) * page_size
        tokens = base[:cut] + tokens[: rng.randint(0, 2) * block * page_size]
    return tokens


def block_pages(page_size: int) -> int:
    """Pages per block of the random keys: a block holds at least 12 tokens, so a node of one
    block is over SGLang's load-back threshold (10 tokens) and most host hits load back."""
    return max(1, num_pages(12, page_size))


def generate_hi_ops(seed: int, page_size: int, num_ops: int, block: Optional[int] = None) -> list[Op]:
    """A random operation sequence over `KINDS` (handles refer to earlier match ops); keys are
    1 to 8 blocks of `block` pages (default `block_pages`)."""
    import random

    block = block or block_pages(page_size)
    rng = random.Random(seed)
    ops: list[Op] = []
    known: list[tuple[int, ...]] = []
    matches: list[int] = []
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    while len(ops) < num_ops:
        kind = rng.choices(kinds, weights)[0]
        if kind in ("insert", "chunk", "match"):
            tokens = random_tokens(rng, page_size, known, block)
            if kind != "match":
                known.append(tokens)
            ops.append(Op(kind, tokens))
            if kind == "match":
                matches.append(len(ops) - 1)
                if rng.random() < 0.5:  # as admission does: load the host hit back at once
                    ops.append(Op("load", len(ops) - 1))
        elif kind in ("load", "lock", "unlock"):
            ops.append(Op(kind, rng.choice(matches[-4:]) if matches else 0))
        elif kind in ("evict", "evict_host"):
            ops.append(Op(kind, rng.randint(1, 3) * block * page_size))
        else:
            ops.append(Op("events", None))
    return ops
