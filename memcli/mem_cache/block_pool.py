"""vLLM 0.33's block pool for one full-attention group: blocks, the cached-block map, the
ordered free queue, and the chained block hashes its KV events carry.

    pool = BlockPool(num_blocks)           block 0 is the null block (never handed out)
    pool.get_new_blocks(n)                 from the head of the free queue; a cached block
                                           popped there is evicted then (lazily)
    pool.touch(blocks)                     a hit: blocks with no holder leave the queue
    pool.free_blocks(blocks)               in eviction order: blocks reaching no holder go
                                           to the head (no hash) or the tail (hashed)
    pool.cache_full_blocks(...)            register a request's newly full blocks

Hashes are vLLM's: `sha256(pickle((parent hash or NONE_HASH, block tokens, extra keys)))`,
32 bytes. vLLM keys its map by the hash with the group id appended (4 big-endian bytes); with
one group that suffix is the same for every key, so the map here is keyed by the hash itself
(the same entries, one to one, and the hash objects a request already holds, whose Python
hash is computed once). The map keeps duplicates (two blocks with one key) and serves the
first inserted. On a large pool the map's lookups are cache misses, so each block evicted or
cached takes one (`pop`, `setdefault`) where a lookup and a write would take two.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from array import array
from operator import attrgetter
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

import numpy as np

from memcli.errors import IntegrityError

NONE_HASH_SEED = "vllm-none-hash"  # vLLM's seed for sha256 when PYTHONHASHSEED is unset
MEDIUM_GPU = "GPU"


def sha256(value: Any) -> bytes:
    """vLLM's default prefix-caching hash: SHA-256 of the highest-protocol pickle."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash() -> bytes:
    """The parent hash of a first block: the hash of `PYTHONHASHSEED`, else of vLLM's seed."""
    seed = os.getenv("PYTHONHASHSEED")
    return sha256(NONE_HASH_SEED if seed is None else seed)


def external_hash(block_hash: bytes) -> int:
    """A block hash as vLLM's KV events carry it by default
    (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`): the low 64 bits of its big-endian value."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def block_hashes(tokens: Sequence[int], block_size: int, start: int = 0, parent: Optional[bytes] = None,
                 first_extra: Optional[tuple] = None, root: Optional[bytes] = None) -> list[bytes]:
    """Chained hashes of the full blocks of `tokens` (a list of ints or an int array) from
    block `start` on; `parent` is the hash of block `start - 1` (None for the first block,
    which then hashes `root`, the none-hash), `first_extra` the extra keys of block 0 (vLLM's
    `("cache_salt", salt)`). Many blocks at once are hashed from their pickles' bytes built
    in numpy (`_chain_pickled`), each the bytes `pickle.dumps` gives."""
    out: list[bytes] = []
    prev = parent if parent is not None else (root if root is not None else none_hash())
    end = len(tokens) // block_size
    if start == 0 and first_extra is not None and end > 0:  # the salted first block: pickled as is
        prev = sha256((prev, tuple(int(t) for t in tokens[:block_size]), first_extra))
        out.append(prev)
        start = 1
    if end - start >= FAST_HASH_MIN_BLOCKS and block_size >= 4:
        return out + _chain_pickled(tokens, block_size, start, end, prev)
    if isinstance(tokens, np.ndarray):  # pickled as Python ints
        tokens = tokens[start * block_size:end * block_size].tolist()
        end, start = end - start, 0
    for i in range(start, end):  # block 0's extra keys were taken above
        prev = sha256((prev, tuple(tokens[i * block_size:(i + 1) * block_size]), None))
        out.append(prev)
    return out


# The pickle (protocol 5) of `(parent, tokens, None)`, a 32-byte parent and a tuple of four
# or more ints: PROTO 5, FRAME of the length after it, SHORT_BINBYTES 32 + MEMOIZE, MARK,
# each int (BININT1 `K` below 256, BININT2 `M` below 65536, BININT `J` within int32), TUPLE
# + MEMOIZE, NONE, TUPLE3 + MEMOIZE, STOP. An int outside int32 (pickled as LONG1) sends its
# block to `pickle` itself.
FAST_HASH_MIN_BLOCKS = 4  # fewer blocks: pickled one by one (the arrays cost more than they save)
_PICKLE_MID, _PICKLE_TAIL = b"\x94(", b"t\x94N\x87\x94."
_PICKLE_HEADS: dict[int, Any] = {}  # by the ints' bytes: a SHA-256 that has taken what precedes the parent


def _pickle_head(token_bytes: int) -> Any:
    """A SHA-256 object fed what precedes the parent's 32 bytes in a block pickle whose ints
    take `token_bytes` (copied per block, then fed the rest)."""
    head = _PICKLE_HEADS.get(token_bytes)
    if head is None:
        head = _PICKLE_HEADS[token_bytes] = hashlib.sha256(
            b"\x80\x05\x95" + (token_bytes + 42).to_bytes(8, "little") + b"C ")
    return head


def _chain_pickled(tokens, block_size: int, start: int, end: int, prev: bytes) -> list[bytes]:
    """`block_hashes` of blocks `start`..`end - 1` (no extra keys), `prev` the parent of the
    first: what follows the parent in each block's pickle is built for all blocks at once in
    numpy, and each hash is a copy of its head's SHA-256 fed the parent and that. A block of
    BININTs only has one layout (its slot row as is); a block with shorter ints drops the
    unused bytes of their slots; a block with an int past int32 (LONG1) is pickled as it is."""
    t = np.asarray(tokens[start * block_size:end * block_size], dtype=np.int64)
    n, blocks = len(t), end - start
    mid, tail = len(_PICKLE_MID), len(_PICKLE_TAIL)
    width = mid + 5 * block_size + tail
    rest = np.empty((blocks, width), dtype=np.uint8)  # per block: MEMOIZE MARK, the ints, the tail
    rest[:, :mid] = np.frombuffer(_PICKLE_MID, np.uint8)
    rest[:, width - tail:] = np.frombuffer(_PICKLE_TAIL, np.uint8)
    # Each int's opcode and its int32 bytes, little-endian (a view: block, int, byte).
    ints = rest[:, mid: width - tail].reshape(blocks, block_size, 5)
    ints[:, :, 1:] = t.astype("<i4").view(np.uint8).reshape(blocks, block_size, 4)
    ints[:, :, 0] = ord("J")
    short = (t >= 0) & (t <= 0xFFFF)
    wide = (t < -0x80000000) | (t > 0x7FFFFFFF)
    # Per block: 0 every int a BININT, 1 some shorter, 2 some past int32.
    kind = (short.reshape(blocks, block_size).any(axis=1).astype(np.int8)
            | (wide.reshape(blocks, block_size).any(axis=1).astype(np.int8) << 1))
    view, out = memoryview(rest.reshape(-1)), []
    if not kind.any():
        return _chain_rows(view, width, 0, blocks, _pickle_head(5 * block_size), prev, out)
    kinds = kind.tolist()
    short_rows = np.flatnonzero(kind == 1)
    if len(short_rows):  # their ints in their short forms (the low bytes of the slot)
        size = np.where(short & (t <= 0xFF), 2, np.where(short, 3, 5)).reshape(blocks, block_size)[short_rows]
        sub = rest[short_rows]
        sub_ints = sub[:, mid: width - tail].reshape(len(short_rows), block_size, 5)
        sub_ints[:, :, 0] = np.where(size == 2, ord("K"), np.where(size == 3, ord("M"), ord("J")))
        keep = np.ones(sub.shape, dtype=bool)
        keep[:, mid: width - tail].reshape(len(short_rows), block_size, 5)[:] = np.arange(5) < size[:, :, None]
        short_view = memoryview(sub[keep].tobytes())
        short_ends = np.cumsum(size.sum(axis=1) + mid + tail).tolist()
    k, s_at = 0, 0
    while k < blocks:
        if kinds[k] == 0:  # a run of BININT blocks
            j = k
            while j < blocks and kinds[j] == 0:
                j += 1
            prev = _chain_rows(view, width, k, j, _pickle_head(5 * block_size), prev, out)[-1]
            k = j
            continue
        if kinds[k] == 1:
            a = short_ends[s_at - 1] if s_at else 0
            b = short_ends[s_at]
            s_at += 1
            h = _pickle_head(b - a - mid - tail).copy()
            h.update(prev)
            h.update(short_view[a:b])
            prev = h.digest()
        else:
            i = start + k
            prev = sha256((prev, tuple(int(x) for x in tokens[i * block_size:(i + 1) * block_size]), None))
        out.append(prev)
        k += 1
    return out


def _chain_rows(view: memoryview, width: int, first: int, stop: int, head: Any, prev: bytes, out: list) -> list:
    """The chain through rows `first`..`stop - 1` of `view` (`width` bytes each, one layout,
    `head` its SHA-256 head), appended to `out`, which is returned."""
    append = out.append
    for at in range(first * width, stop * width, width):
        h = head.copy()
        h.update(prev)
        h.update(view[at: at + width])
        prev = h.digest()
        append(prev)
    return out


_ref_cnt, _block_id, _key = attrgetter("ref_cnt"), attrgetter("block_id"), attrgetter("key")


class Block:
    """One KV block: its holders (`ref_cnt`), its map key while cached, its links in the
    free queue (None when not in it), and, for the eviction log, when it was cached (on the
    pool's clock) and how many prefix hits took it since."""

    __slots__ = ("block_id", "ref_cnt", "key", "prev", "next", "is_null", "cached_at", "hits")

    def __init__(self, block_id: int):
        self.block_id, self.ref_cnt, self.key = block_id, 0, None
        self.cached_at, self.hits = 0.0, 0
        self.prev: Optional[Block] = None
        self.next: Optional[Block] = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.key is not None})"


class FreeQueue:
    """vLLM's free-block queue: a doubly linked list, head = next block handed out."""

    def __init__(self, blocks: list[Block]):
        self.head, self.tail = Block(-1), Block(-2)
        self.num_free = 0
        self.head.next, self.tail.prev = self.tail, self.head
        self.append_n(blocks)

    def popleft_n(self, n: int) -> list[Block]:
        out, block = [], self.head.next
        for _ in range(n):
            if block is self.tail:
                raise IntegrityError(f"free queue ran out after {len(out)} of {n} blocks")
            out.append(block)
            nxt = block.next
            block.prev = block.next = None
            block = nxt
        self.head.next, block.prev = block, self.head
        self.num_free -= n
        return out

    def remove(self, block: Block) -> None:
        if block.prev is None:
            raise IntegrityError(f"block {block.block_id} is not in the free queue")
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def append_n(self, blocks: list[Block]) -> None:
        last = self.tail.prev
        for block in blocks:
            last.next, block.prev = block, last
            last = block
        last.next, self.tail.prev = self.tail, last
        self.num_free += len(blocks)

    def prepend_n(self, blocks: list[Block]) -> None:
        first, prev = self.head.next, self.head
        for block in blocks:
            prev.next, block.prev = block, prev
            prev = block
        prev.next, first.prev = first, prev
        self.num_free += len(blocks)

    def ids(self) -> list[int]:
        """Block ids from head to tail (O(queue); checks and tests)."""
        out, block = [], self.head.next
        while block is not self.tail:
            out.append(block.block_id)
            block = block.next
        return out


class Removed(NamedTuple):
    """A cached block evicted when reused: its hash (without the group id), its block, the
    time from its caching to its eviction on the pool's clock, and the prefix hits it served."""

    block_hash: bytes
    block_id: int
    age: float = 0.0
    hits: int = 0


class BlockPool:
    """`num_blocks` blocks (block 0 the null block), the cached map and the free queue.

    `events`: KV events (`kv_events` stand-ins of vLLM's: stored / removed) when `record_events`.
    `evicted`: cached blocks evicted by reuse since the caller last drained them (`Removed`
    records, built on reading; the pool keeps their fields as columns, `take_evicted`).
    `clock`: the time eviction ages are measured on (a zero-argument callable; the scheduler's
    simulated clock in a replay).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False):
        if num_blocks < 2:
            raise IntegrityError(f"a block pool needs the null block and at least one more, got {num_blocks}")
        self.num_blocks, self.enable_caching, self.record_events = num_blocks, enable_caching, record_events
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free = FreeQueue(self.blocks)
        # vLLM's map: a key's one block, or, once a second block has that key, {block id: block}
        # in insertion order (the first inserted is served).
        self.cached: dict[bytes, Any] = {}
        self.null_block = self.free.popleft_n(1)[0]
        self.null_block.is_null = True
        self.events: list = []
        # Evictions since the last drain, one list per field: appended per evicted block, where
        # a record per block cost more than the eviction itself.
        self._evicted: tuple[list, list, array, array] = ([], [], array("d"), array("q"))
        self.num_evicted = 0  # cached blocks evicted by reuse, since the pool was built
        self.num_cached = 0  # blocks holding a hash
        self.num_cached_free = 0  # of which in the free queue (evictable)
        self.clock: Callable[[], float] = lambda: 0.0
        # With a step check attached: the blocks each call changed (lists of blocks; None: not kept).
        self.dirty: Optional[list] = None

    # -- lookups --------------------------------------------------------------------------
    def get_cached_block(self, block_hash: bytes) -> Optional[Block]:
        found = self.cached.get(block_hash)
        if found is None or type(found) is Block:
            return found
        return next(iter(found.values()))

    def cached_blocks(self) -> list[tuple[bytes, Block]]:
        """(key, block) of every entry of the map (O(map); checks and tests)."""
        return [(key, block) for key, entry in self.cached.items()
                for block in ((entry,) if type(entry) is Block else entry.values())]

    @property
    def num_free_blocks(self) -> int:
        return self.free.num_free

    def usage(self) -> float:
        """vLLM's KV-cache usage: 1 - free / (blocks - null block)."""
        usable = self.num_blocks - 1
        return 1.0 - self.free.num_free / usable if usable else 0.0

    # -- hand-out, hits and frees ---------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[Block]:
        if n > self.free.num_free:
            raise IntegrityError(f"cannot get {n} free blocks from a pool with {self.free.num_free} free")
        out = self.free.popleft_n(n)
        if self.dirty is not None:
            self.dirty.append(out)
        now = None  # the clock, read once: nothing moves it while blocks are handed out
        for block in out:
            if block.key is not None:
                if now is None:
                    now = self.clock()
                self._evict(block, now)
            if block.ref_cnt:
                raise IntegrityError(f"block {block.block_id} was in the free queue with {block.ref_cnt} holders")
            block.ref_cnt = 1
        return out

    def _evict(self, block: Block, now: float) -> None:
        """A cached block handed out again leaves the map (at time `now`, for its age); it was
        a free cached block."""
        self.num_cached_free -= 1
        key = block.key
        cached = self.cached
        entry = cached.pop(key, None)
        if entry is None:
            removed = False
        elif entry is block:
            removed = True
        elif type(entry) is Block:
            removed = False
            cached[key] = entry
        else:
            removed = entry.pop(block.block_id, None) is not None
            if entry:
                cached[key] = entry
        if removed:
            self.num_cached -= 1
            self.num_evicted += 1
            keys, ids, ages, hits = self._evicted
            keys.append(key)
            ids.append(block.block_id)
            ages.append(now - block.cached_at)
            hits.append(block.hits)
            if self.record_events:
                from memcli.mem_cache.kv_events import VllmBlockRemoved
                self.events.append(VllmBlockRemoved([external_hash(key)], MEDIUM_GPU))
        block.key = None

    @property
    def evicted(self) -> list[Removed]:
        """The evictions not yet drained, as records (oldest first)."""
        keys, ids, ages, hits = self._evicted
        return [Removed(key, *fields) for key, *fields in zip(keys, ids, ages, hits)]

    def take_evicted(self) -> tuple[array, array]:
        """(ages, hits) of the evictions since the last call, oldest first; drains them."""
        _, _, ages, hits = self._evicted
        self._evicted = ([], [], array("d"), array("q"))
        return ages, hits

    def touch(self, blocks: Iterable[Block]) -> None:
        if self.dirty is not None:
            blocks = list(blocks)
            self.dirty.append(blocks)
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free.remove(block)
                self.num_cached_free -= block.key is not None
            block.ref_cnt += 1
            block.hits += 1

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Blocks in eviction order (the first evicted first)."""
        first, last = [], []
        to_first, to_last = first.append, (last if self.enable_caching else first).append
        if self.dirty is not None:
            ordered = list(ordered)
            self.dirty.append(ordered)
        for block in ordered:
            if block.is_null:
                continue
            held = block.ref_cnt - 1
            block.ref_cnt = held
            if not held:
                (to_first if block.key is None else to_last)(block)
            elif held < 0:
                raise IntegrityError(f"block {block.block_id} freed more often than it was held")
        self.free.prepend_n(first)
        self.free.append_n(last)
        if self.enable_caching:
            self.num_cached_free += len(last)
        else:
            self.num_cached_free += sum(1 for b in first if b.key is not None)

    # -- caching --------------------------------------------------------------------------
    def cache_full_blocks(self, blocks: list[Block], hashes: Sequence[bytes], num_cached: int, num_full: int,
                          block_size: int, token_ids: Optional[Sequence[int]] = None,
                          first_extra: Optional[tuple] = None, event_block_size: Optional[int] = None) -> None:
        """Register `blocks[num_cached:num_full]` under `hashes[num_cached:num_full]`; with
        events on, one stored event for them (`token_ids`: the request's tokens; the event says
        `event_block_size`, None: `block_size`)."""
        if num_cached >= num_full:
            return
        now, cached, added = self.clock(), self.cached, 0
        if self.dirty is not None:
            self.dirty.append(blocks[num_cached:num_full])
        for block, key in zip(blocks[num_cached:num_full], hashes[num_cached:num_full]):
            if block.is_null:
                continue
            if block.key is not None:
                raise IntegrityError(f"block {block.block_id} is cached twice")
            entry = cached.setdefault(key, block)
            if entry is not block:  # the hash has a block already: vLLM keeps both, serves the first
                if type(entry) is Block:
                    cached[key] = {entry.block_id: entry, block.block_id: block}
                elif block.block_id in entry:
                    continue
                else:
                    entry[block.block_id] = block
            block.key, block.cached_at, block.hits = key, now, 0
            added += 1
        self.num_cached += added
        if self.record_events:
            from memcli.mem_cache.kv_events import VllmBlockStored
            new_hashes = [external_hash(hashes[i]) for i in range(num_cached, num_full) if not blocks[i].is_null]
            parent = external_hash(hashes[num_cached - 1]) if num_cached else None
            # Published untagged, one entry per block: a cache salt as (salt,).
            salt = None if first_extra is None else tuple(key[1] for key in first_extra)
            extra = [salt if i == 0 else None for i in range(num_cached, num_full)]
            self.events.append(VllmBlockStored(
                new_hashes, parent, list(token_ids[num_cached * block_size:num_full * block_size]),
                event_block_size or block_size, MEDIUM_GPU, extra or None))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (only when no request holds one)."""
        if self.num_blocks - self.free.num_free != 1:
            return False
        if self.dirty is not None:
            self.dirty.append([block for block in self.blocks if block.key is not None])
        self.cached.clear()
        for block in self.blocks:
            block.key = None
        self.num_cached = self.num_cached_free = 0
        if self.record_events:
            from memcli.mem_cache.kv_events import VllmAllBlocksCleared
            self.events.append(VllmAllBlocksCleared())
        return True

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events

    def check(self) -> list[str]:
        """The pool's own invariants (O(pool)): what is wrong, or nothing."""
        return self.walk()[0]

    def walk(self) -> tuple[list[str], np.ndarray]:
        """`check`'s problems, and every block's reference count as it read them."""
        problems = []
        queued = np.asarray(self.free.ids(), dtype=np.int64)
        times = np.bincount(queued, minlength=self.num_blocks)
        if len(queued) != self.free.num_free or (len(queued) and times.max() > 1):
            problems.append(f"free queue holds {len(queued)} links for {self.free.num_free} free blocks")
        in_queue = times[:self.num_blocks] > 0
        ref = np.fromiter(map(_ref_cnt, self.blocks), dtype=np.int64, count=self.num_blocks)
        for block in (np.flatnonzero(in_queue[1:] != (ref[1:] == 0)) + 1).tolist():
            problems.append(f"block {block}: {ref[block]} holders, in free queue: {bool(in_queue[block])}")
        cached = list(self.cached.values())
        if set(map(type, cached)) - {Block}:  # a hash with several blocks: each of them
            cached = [block for entry in cached for block in ((entry,) if type(entry) is Block else entry.values())]
        ids = np.fromiter(map(_block_id, cached), dtype=np.int64, count=len(cached))
        if len(cached) != self.num_cached or int(np.count_nonzero(ref[ids] == 0)) != self.num_cached_free:
            problems.append(f"cached-block counters {self.num_cached}/{self.num_cached_free} disagree with the map")
        if None in list(map(_key, cached)) or (ids == 0).any() or in_queue[0]:
            problems.append("the map holds an unhashed or the null block, or the null block is queued")
        return problems[:8], ref
