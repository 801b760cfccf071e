"""vLLM 0.33's KV-cache manager for one full-attention group, behind the verbs its scheduler
uses, plus what memcli's tools read from any memory (usage, held pages, checks, events).

    scheduler                                   BlockManager
    a waiting request                     ->    get_computed_blocks   -> (blocks, hit tokens)
    tokens to schedule (+ the hit)        ->    allocate_slots        -> new blocks | None
    a finished or preempted request       ->    free
    an admitted request and its hit       ->    record_prefix_cache_stats

A request here is any object with `request_id`, `all_token_ids`, `num_prompt_tokens`,
`num_computed_tokens`, `status` (`waiting`, `preempted`, `running`), `num_preemptions` and
`block_hashes` (extended by `hash_request` whenever tokens are appended); `num_tokens` is
`len(all_token_ids)`. Rules (vLLM's `KVCacheManager`, `FullAttentionManager`, `BlockPool`):
a hit is the longest run of cached blocks within `num_tokens - 1` tokens; admission needs the
new blocks plus the hit blocks sitting in the free queue; only full blocks are cached; a
request's blocks are freed deepest first.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple, Optional

import numpy as np

from memcli.errors import IntegrityError
from memcli.mem_cache.block_pool import Block, BlockPool, block_hashes, none_hash
from memcli.mem_cache.manager import Usage


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass
class PrefixCacheStats:
    """vLLM's `PrefixCacheStats`: admissions of fresh requests, and of preempted ones apart."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class BlockEvictions(NamedTuple):
    """Cached blocks evicted by reuse, for the replay's eviction log: the tokens of each (one
    block), their ages and hits (one entry per block, oldest first). The trace's last and next
    use of a block are not tracked."""

    tokens: int
    age: array
    hit_count: array


class BlockCheck(NamedTuple):
    """The result of one full check of the block pool."""

    holders: int
    held_blocks: int
    free_blocks: int

    def to_dict(self) -> dict:
        return {"check": "block_pool", "holders": self.holders, "held_blocks": self.held_blocks,
                "free_blocks": self.free_blocks}


@dataclass
class CheckStats:
    full_walks: int = 0
    incremental: int = 0
    incremental_s: float = 0.0
    walk_s: float = 0.0


class BlockChecker:
    """After-step checks of a block manager.

    Under a checking policy (`every_step` not "none") every step is checked for what it
    changed (`incremental`, O(the blocks the step's calls named and the running requests)):
    each such block's holders equal the requests whose block lists hold it, it is in the free
    queue exactly when it has none, and one cached since the last check is in the map under
    its hash; the pool's counters (free blocks, cached blocks, cached free blocks) equal what
    the checker counts itself; and only running requests hold blocks. `full` walks the whole pool
    every step instead, `both` does both. Otherwise only idle steps walk the pool, at most once
    per `policy.walk_every` of them. A failure raises `IntegrityError` naming the step."""

    def __init__(self, memory: "BlockManager", policy: Any):
        self.memory, self.policy, self.stats, self._idle = memory, policy, CheckStats(), 0
        level = getattr(policy, "every_step", "none")
        self.walks = level in ("full", "both")
        self.tracks = level in ("incremental", "both")
        if self.tracks:
            self._start()

    def _start(self) -> None:
        """The checker's own counts, from the pool as it is (no request holding a block yet)."""
        pool = self.memory.pool
        pool.dirty = []
        self._holders = np.zeros(pool.num_blocks, dtype=np.int64)  # per block: the request lists holding it
        self._seen: dict[str, list] = {}  # request id -> [its block list, the entries counted]
        # Each block's holders and hash flag when last checked (the null block: never idle).
        self._ref = np.array([b.ref_cnt or b.is_null for b in pool.blocks], dtype=np.int64)
        self._keyed = np.array([b.key is not None for b in pool.blocks], dtype=bool)
        idle = self._ref == 0
        self._num_idle = int(np.count_nonzero(idle))
        self._num_keyed = int(np.count_nonzero(self._keyed))
        self._num_keyed_idle = int(np.count_nonzero(self._keyed & idle))

    def after_step(self, step: int, holders: list, idle: bool) -> bool:
        ran = False
        if self.tracks:
            start = time.perf_counter()
            self._check_step(step, holders)
            self.stats.incremental += 1
            self.stats.incremental_s += time.perf_counter() - start
            ran = True
        if not self.walks:
            if not idle:
                return ran
            self._idle += 1
            if (self._idle - 1) % max(1, self.policy.walk_every):
                return ran
        start = time.perf_counter()
        try:
            self.memory.check(holders)
        except IntegrityError as exc:
            raise _at_step(step, "block_walk", str(exc)) from None
        self.stats.full_walks += 1
        self.stats.walk_s += time.perf_counter() - start
        return True

    def _count(self, blocks: list, sign: int, changed: dict) -> None:
        """`blocks` (a request's, the null block aside) gained (+1) or lost (-1) that holder."""
        kept = [b for b in blocks if not b.is_null]
        np.add.at(self._holders, [b.block_id for b in kept], sign)
        changed.update((b.block_id, b) for b in kept)

    def _check_step(self, step: int, holders: list) -> None:
        memory, pool = self.memory, self.memory.pool
        changed = {b.block_id: b for blocks in pool.dirty for b in blocks if not b.is_null}
        pool.dirty = []
        problems = []
        held, seen, running = memory.held, self._seen, _ids(holders)
        for rid, entry in held.items():  # what each request's list gained (lists only grow)
            blocks = entry.blocks
            if blocks and rid not in running:
                problems.append(f"request {rid} holds {len(blocks)} blocks but is not running")
            mark = seen.get(rid)
            if mark is None or mark[0] is not blocks:
                if mark is not None:
                    self._count(mark[0][:mark[1]], -1, changed)
                mark = seen[rid] = [blocks, 0]
            if len(blocks) != mark[1]:
                if len(blocks) < mark[1]:
                    problems.append(f"request {rid} holds {len(blocks)} blocks, fewer than the {mark[1]} it held")
                self._count(blocks[mark[1]:], 1, changed)
                mark[1] = len(blocks)
        if len(seen) != len(held):  # released: its blocks lose a holder
            for rid in [rid for rid in seen if rid not in held]:
                blocks, n = seen.pop(rid)
                self._count(blocks[:n], -1, changed)
        if changed:
            self._check_blocks(changed, problems)
        if (self._num_idle, self._num_keyed, self._num_keyed_idle) != (pool.num_free_blocks, pool.num_cached,
                                                                      pool.num_cached_free):
            problems.append(f"pool counters: {pool.num_free_blocks} free, {pool.num_cached} cached, {pool.num_cached_free}"
                            f" cached free; the blocks say {self._num_idle}, {self._num_keyed}, {self._num_keyed_idle}")
        if problems:
            raise _at_step(step, "block_step", "; ".join(problems[:4]))

    def _check_blocks(self, changed: dict, problems: list) -> None:
        """The blocks `changed` (by id): holders, queue membership and map entry; the counts
        of idle, cached and cached idle blocks moved by what changed in them."""
        cached = self.memory.pool.cached
        ids = np.fromiter(changed, dtype=np.int64, count=len(changed))
        blocks = list(changed.values())
        ref = np.fromiter((b.ref_cnt for b in blocks), dtype=np.int64, count=len(blocks))
        counted = self._holders[ids]
        wrong = np.flatnonzero(ref != counted)
        if len(wrong):
            i = int(wrong[0])
            problems.append(f"block {int(ids[i])}: {int(ref[i])} holders counted, {int(counted[i])} requests hold it")
        idle = ref == 0
        queued = np.fromiter((b.prev is not None for b in blocks), dtype=bool, count=len(blocks))
        wrong = np.flatnonzero(queued != idle)
        if len(wrong):
            i = int(wrong[0])
            problems.append(f"block {int(ids[i])}: {int(ref[i])} holders, in free queue: {bool(queued[i])}")
        keyed = np.fromiter((b.key is not None for b in blocks), dtype=bool, count=len(blocks))
        was_idle, was_keyed = self._ref[ids] == 0, self._keyed[ids]
        # Blocks cached since the last check are in the map under their hash (a block that
        # stays cached keeps its entry: only an eviction, of that block, takes it out).
        fresh = [blocks[i] for i in np.flatnonzero(keyed & ~was_keyed).tolist()]
        entries = list(map(cached.get, [b.key for b in fresh]))
        if entries != fresh:
            for block, entry in zip(fresh, entries):
                if entry is not block and not (type(entry) is dict and entry.get(block.block_id) is block):
                    problems.append(f"block {block.block_id} is cached, but its hash maps to {entry}")
                    break
        self._num_idle += int(np.count_nonzero(idle)) - int(np.count_nonzero(was_idle))
        self._num_keyed += int(np.count_nonzero(keyed)) - int(np.count_nonzero(was_keyed))
        self._num_keyed_idle += int(np.count_nonzero(keyed & idle)) - int(np.count_nonzero(was_keyed & was_idle))
        self._ref[ids], self._keyed[ids] = ref, keyed


def _ids(holders: list) -> set:
    return {getattr(r, "request_id", None) for r in holders}


def _at_step(step: int, check: str, message: str) -> IntegrityError:
    error = IntegrityError(f"step {step}: {check}: {message}")
    error.step, error.check = step, check
    return error


@dataclass
class _Held:
    blocks: list = field(default_factory=list)
    num_cached: Optional[int] = None  # None until the first allocation (vLLM's `num_cached_block` key)


class BlockManager:
    """vLLM's KV-cache manager over `num_blocks` blocks of `block_size` tokens (block 0 null)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, *, enable_caching: bool = True,
                 watermark: float = 0.0, record_events: bool = False, max_running: int = 1 << 30,
                 config: Any = None):
        self.pool = BlockPool(num_blocks, enable_caching, record_events)
        self.block_size, self.max_model_len = block_size, max_model_len
        # vLLM's hasher and its KV events take their own block size (equal to the pool's unless
        # check-page-size injects another).
        self.hash_block_size = self.event_block_size = block_size
        self.enable_caching, self.max_running = enable_caching, max_running
        self.watermark_blocks = int(watermark * num_blocks)
        self.held: dict[str, _Held] = {}
        self.stats = PrefixCacheStats()
        self.root_hash = none_hash()
        self.prompt_chains: Any = None  # `share_prompt_hashes`
        self.clock = lambda: 0.0
        self.stack = SimpleNamespace(memory=self, device="cpu", backend="torch", config=config)

    # -- what memory is -------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.block_size

    @property
    def size(self) -> int:
        """Usable KV slots: every block but the null block."""
        return (self.pool.num_blocks - 1) * self.block_size

    @property
    def sharing(self) -> bool:
        return self.enable_caching

    def usage(self) -> Usage:
        """Tokens of free blocks without a hash, of cached free blocks, of cached held blocks."""
        pool, bs = self.pool, self.block_size
        free_cached = pool.num_cached_free
        return Usage((pool.num_free_blocks - free_cached) * bs, free_cached * bs, (pool.num_cached - free_cached) * bs)

    def held_pages(self, usage: Usage) -> int:
        """Blocks held by requests (shared ones once)."""
        return self.pool.num_blocks - 1 - self.pool.num_free_blocks

    def vllm_usage(self) -> float:
        """vLLM's reported KV-cache usage (held blocks over usable blocks)."""
        return self.pool.usage()

    def rows_in_use(self) -> int:
        return sum(1 for held in self.held.values() if held.blocks)

    @property
    def in_use_tokens(self) -> int:
        return self.held_pages(self.usage()) * self.block_size

    # -- hashing --------------------------------------------------------------------------
    def hash_request(self, req: Any) -> None:
        """Extend `req.block_hashes` over its newly full blocks (vLLM's request block hasher).
        A prompt's first hashes come from `prompt_chains` where one is attached (the same
        values, computed once where prompts share a prefix)."""
        tokens, hashes, size = req.all_token_ids, req.block_hashes, self.hash_block_size
        if (len(hashes) + 1) * size > len(tokens):
            return
        if not hashes and self.prompt_chains is not None:
            def compute(start: int, parent: Optional[bytes]) -> list:
                return block_hashes(tokens, size, start, parent, req.extra_keys, self.root_hash)

            shared = self.prompt_chains.prompt_values(req.request_id, len(tokens) // size, compute)
            if shared is not None:
                hashes.extend(shared)
                return
        parent = hashes[-1] if hashes else None
        hashes.extend(block_hashes(tokens, size, len(hashes), parent, req.extra_keys, self.root_hash))

    def share_prompt_hashes(self, chains: Any) -> bool:
        """Take the prompts' first block hashes from `chains(block_size)` (a
        `workload.chains.SharedPrefixChains` of the trace, whose requests are then built in its
        order); False, with nothing attached, where the hasher's block size is not the pool's or
        prefix caching is off."""
        if self.hash_block_size != self.block_size or not self.enable_caching:
            return False
        self.prompt_chains = chains(self.block_size)
        return True

    # -- vLLM's verbs ---------------------------------------------------------------------
    def get_computed_blocks(self, req: Any) -> tuple[list[Block], int]:
        """The longest run of cached blocks within `num_tokens - 1` tokens, and its tokens."""
        if not self.enable_caching or req.skip_reading_prefix_cache:
            return [], 0
        limit = (len(req.all_token_ids) - 1) // self.block_size
        found, get = [], self.pool.get_cached_block
        for block_hash in req.block_hashes[:limit]:
            block = get(block_hash)
            if block is None:
                break
            found.append(block)
        return found, len(found) * self.block_size

    def _blocks_to_allocate(self, held: Optional[_Held], num_tokens: int, new_computed: list[Block]) -> int:
        required = cdiv(num_tokens, self.block_size)
        have = len(held.blocks) if held is not None else 0
        if held is not None and held.num_cached is not None:
            return max(required - have, 0)
        evictable = sum(1 for b in new_computed if b.ref_cnt == 0 and not b.is_null)
        return max(required - (len(new_computed) + have), 0) + evictable

    def allocate_slots(self, req: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Optional[list[Block]] = None, num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False, has_scheduled_reqs: bool = True) -> Optional[list[Block]]:
        """Blocks for `num_new_tokens` more tokens (after adopting the hit); None (nothing
        taken) when they do not fit. Caches the request's blocks that became full."""
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise IntegrityError(f"request {req.request_id}: allocate_slots of no tokens")
        held = self.held.get(req.request_id)
        if (held is not None and held.num_cached is not None and new_computed_blocks is None
                and not num_new_computed_tokens and not full_sequence_must_fit):
            # A running request's next tokens (a decode step): when its blocks hold them, no
            # block becomes full and no watermark refuses it, the call below takes and caches
            # nothing and returns no blocks. Tested here first, in the call's own terms.
            computed, size = req.num_computed_tokens, self.block_size
            scheduled = min(computed, self.max_model_len) + num_new_tokens
            if (min(scheduled + num_lookahead_tokens, self.max_model_len) <= len(held.blocks) * size
                    and (not self.enable_caching
                         or min(scheduled, len(req.all_token_ids), len(req.block_hashes) * size) // size
                         <= held.num_cached)
                    and (self.watermark_blocks <= self.pool.num_free_blocks or not has_scheduled_reqs
                         or req.status not in ("waiting", "preempted"))):
                return []
        new_computed = new_computed_blocks or []
        local = req.num_computed_tokens + num_new_computed_tokens
        total = min(local, self.max_model_len)
        watermark = self.watermark_blocks if has_scheduled_reqs and req.status in ("waiting", "preempted") else 0
        free = self.pool.num_free_blocks
        if full_sequence_must_fit:
            whole = min(len(req.all_token_ids), self.max_model_len)
            if self._blocks_to_allocate(held, whole, new_computed) + watermark > free:
                return None
        need_slot = min(total + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        if self._blocks_to_allocate(held, need_slot, new_computed) + watermark > free:
            return None
        if held is None:
            held = self.held[req.request_id] = _Held()
        if new_computed_blocks is not None and held.num_cached is None:
            if self.enable_caching:
                self.pool.touch(new_computed)
            held.blocks.extend(new_computed)
            held.num_cached = len(held.blocks)
        grow = cdiv(need_slot, self.block_size) - len(held.blocks)
        new = self.pool.get_new_blocks(grow) if grow > 0 else []
        held.blocks.extend(new)
        if self.enable_caching:
            self._cache_blocks(req, held, min(total + num_new_tokens, len(req.all_token_ids)))
        return new

    def token_appended(self, req: Any, cache_upto: Optional[int] = None) -> None:
        """A sampled token was appended to `req`: `hash_request(req)`, then, with `cache_upto`,
        `cache_blocks(req, cache_upto)` (a running request's output processed), in one call per
        token."""
        # `hash_request`'s own test, made here first: most tokens fill no block.
        if (len(req.block_hashes) + 1) * self.hash_block_size <= len(req.all_token_ids):
            self.hash_request(req)
        if cache_upto is not None:
            self.cache_blocks(req, cache_upto)

    def cache_blocks(self, req: Any, num_tokens: int) -> None:
        """Cache the request's blocks that are full within its first `num_tokens` tokens
        (vLLM's `KVCacheManager.cache_blocks`, called when a step's output comes back)."""
        held = self.held.get(req.request_id)
        if self.enable_caching and held is not None:
            self._cache_blocks(req, held, num_tokens)

    def _cache_blocks(self, req: Any, held: _Held, num_tokens: int) -> None:
        cached = held.num_cached or 0
        full = min(num_tokens, len(req.block_hashes) * self.block_size) // self.block_size
        if cached >= full:
            if held.num_cached is None:
                held.num_cached = cached
            return
        self.pool.cache_full_blocks(held.blocks, req.block_hashes, cached, full, self.block_size,
                                    req.all_token_ids if self.pool.record_events else None, req.extra_keys,
                                    self.event_block_size)
        held.num_cached = full

    def free(self, req: Any) -> None:
        """Give back the request's blocks, deepest first (hashed ones stay cached)."""
        held = self.held.pop(req.request_id, None)
        if held is not None:
            self.pool.free_blocks(reversed(held.blocks))

    def record_prefix_cache_stats(self, req: Any, num_hits: int) -> None:
        if self.enable_caching and not req.skip_reading_prefix_cache:
            self.stats.record(len(req.all_token_ids), num_hits, req.num_preemptions > 0)

    def block_ids(self, req: Any) -> list[int]:
        held = self.held.get(req.request_id)
        return [] if held is None else [b.block_id for b in held.blocks]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    # -- what the tools read --------------------------------------------------------------
    def checker(self, policy: Any) -> BlockChecker:
        return BlockChecker(self, policy)

    def check(self, holders: list) -> list:
        """The full check: the pool's invariants, and every block's holders equal to the
        requests that hold it (`holders`: the requests holding memory). Raises on a failure."""
        problems, ref = self.pool.walk()
        ids = _ids(holders)
        held_ids: list = []
        for rid, held in self.held.items():
            if rid not in ids and held.blocks:
                problems.append(f"request {rid} holds {len(held.blocks)} blocks but is not running")
            held_ids += [b.block_id for b in held.blocks if not b.is_null]
        counts = np.bincount(np.asarray(held_ids, dtype=np.int64), minlength=self.pool.num_blocks)
        wrong = np.flatnonzero(ref[1:] != counts[1:len(ref)])
        if len(wrong):
            block = int(wrong[0]) + 1
            problems.append(f"block {block}: {ref[block]} holders counted, {counts[block]} requests hold it")
        if problems:
            raise IntegrityError("block pool check failed: " + "; ".join(problems[:4]))
        return [BlockCheck(len(self.held), int(np.count_nonzero(counts)), self.pool.num_free_blocks)]

    def idle_state(self) -> dict:
        u = self.usage()
        ok = not self.held and u.protected == 0 and u.available + u.evictable == self.size
        return {"ok": ok, "size": self.size, "available": u.available, "evictable": u.evictable,
                "protected": u.protected, "rows_free": self.max_running - self.rows_in_use(), "rows": self.max_running,
                "allocator_integrity": self.pool.check()}

    def take_events(self) -> list:
        return self.pool.take_events()

    @property
    def evicted_tokens_total(self) -> int:
        """Tokens of cached blocks evicted by reuse since the manager was built."""
        return self.pool.num_evicted * self.block_size

    def take_evictions(self) -> "BlockEvictions | list":
        ages, hits = self.pool.take_evicted()
        if not ages:
            return []
        return BlockEvictions(self.block_size, ages, hits)

    def allocator_totals(self) -> tuple[int, int]:
        return 0, 0

    def host_tier(self) -> None:
        return None

    def finish_copies(self) -> None:
        return None

    def set_clock(self, clock) -> None:
        """The time eviction ages are measured on (a zero-argument callable)."""
        self.clock = clock
        self.pool.clock = clock
