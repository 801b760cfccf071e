"""vLLM 0.33's block pool for one full-attention group: blocks, the cached-block map, the
ordered free queue, and the chained block hashes its KV events carry.

    pool = BlockPool(num_blocks)           block 0 is the null block (never handed out)
    pool.get_new_blocks(n)                 from the head of the free queue; a cached block
                                           popped there is evicted then (lazily)
    pool.touch(blocks)                     a hit: blocks with no holder leave the queue
    pool.free_blocks(blocks)               in eviction order: blocks reaching no holder go
                                           to the head (no hash) or the tail (hashed)
    pool.cache_full_blocks(...)            register a request's newly full blocks

A block is its id (an int). Hashes are vLLM's: `sha256(pickle((parent hash or NONE_HASH,
block tokens, extra keys)))`, 32 bytes. vLLM keys its map by the hash with the group id
appended (4 big-endian bytes); with one group that suffix is the same for every key, so the
map here is keyed by the hash itself (the same entries, one to one). The map keeps duplicates
(two blocks with one key) and serves the first inserted.

The per-block state lives in arrays (`array` objects with numpy views over the same memory):
a call on a few blocks, as a decode step's, reads and writes them one by one, and a call on
many, as a prefill's or a free's, in numpy, with the same result.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from array import array
from itertools import repeat
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

import numpy as np

from memcli.errors import IntegrityError

NONE_HASH_SEED = "vllm-none-hash"  # vLLM's seed for sha256 when PYTHONHASHSEED is unset
MEDIUM_GPU = "GPU"
NULL_BLOCK = 0  # vLLM's null block: block 0, taken out of the free queue when the pool is built
# Calls on fewer blocks than this go block by block (numpy's fixed cost per call is more than
# a short loop's); the tests run the pool with both paths for every call.
VECTOR_MIN = 16


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


def _ints(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


class FreeQueue:
    """vLLM's free-block queue (an intrusive doubly linked list there), head = next block handed
    out: the block ids in queue order in a window `[head, tail)` of an array, with -1 where a
    block left from the middle (a hit's `remove`). `pos` is each block's index in the array
    (-1: not queued). The window is moved to the middle of the array, its holes dropped, when
    an end runs out of room; the order of the blocks is the list's in every state."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        cap = 4 * num_blocks + 64
        self._slots = array("q", [-1]) * cap
        self._slots_np = np.frombuffer(self._slots, dtype=np.int64)
        self._pos = array("q", [-1]) * num_blocks
        self._pos_np = np.frombuffer(self._pos, dtype=np.int64)
        self.head = self.tail = cap // 2
        self.num_free = 0
        self.append_n(list(range(num_blocks)))

    def popleft_n(self, n: int) -> list[int]:
        if n > self.num_free:
            raise IntegrityError(f"free queue ran out after {self.num_free} of {n} blocks")
        if n <= 0:
            return []
        slots, pos, h = self._slots, self._pos, self.head
        if n < VECTOR_MIN:
            out = []
            while len(out) < n:
                block = slots[h]
                h += 1
                if block >= 0:
                    out.append(block)
                    pos[block] = -1
        else:
            view = self._slots_np
            window = view[h:h + n]
            if window.min() >= 0:  # no holes: the next n entries
                out_np = window.copy()
                h += n
            else:
                parts, need = [], n
                while need:
                    chunk = view[h:h + max(2 * need, 64)]
                    live = np.flatnonzero(chunk >= 0)
                    if len(live) >= need:
                        end = int(live[need - 1]) + 1
                        parts.append(chunk[live[:need]])
                        h += end
                        need = 0
                    else:
                        parts.append(chunk[live])
                        need -= len(live)
                        h += len(chunk)
                out_np = np.concatenate(parts)
            self._pos_np[out_np] = -1
            out = out_np.tolist()
        self.head = h  # the entries behind the head are never read again
        self.num_free -= n
        return out

    def remove(self, block: int) -> None:
        i = self._pos[block]
        if i < 0:
            raise IntegrityError(f"block {block} is not in the free queue")
        self._slots[i] = -1
        self._pos[block] = -1
        self.num_free -= 1

    def remove_n(self, blocks: np.ndarray) -> None:
        """`remove` of each of `blocks` (distinct)."""
        at = self._pos_np[blocks]
        if len(at) and at.min() < 0:
            raise IntegrityError(f"block {int(blocks[np.flatnonzero(at < 0)[0]])} is not in the free queue")
        self._slots_np[at] = -1
        self._pos_np[blocks] = -1
        self.num_free -= len(blocks)

    def append_n(self, blocks: Sequence[int]) -> None:
        m = len(blocks)
        if not m:
            return
        if self.tail + m > len(self._slots):
            self._recentre(m)
        t = self.tail
        if m < VECTOR_MIN:
            slots, pos = self._slots, self._pos
            for block in blocks:
                slots[t] = block
                pos[block] = t
                t += 1
        else:
            ids = _ints(blocks)
            self._slots_np[t:t + m] = ids
            self._pos_np[ids] = np.arange(t, t + m)
            t += m
        self.tail = t
        self.num_free += m

    def prepend_n(self, blocks: Sequence[int]) -> None:
        """`blocks` in front of the head, the first of them the new head."""
        m = len(blocks)
        if not m:
            return
        if self.head - m < 0:
            self._recentre(m)
        h = self.head - m
        if m < VECTOR_MIN:
            slots, pos, i = self._slots, self._pos, h
            for block in blocks:
                slots[i] = block
                pos[block] = i
                i += 1
        else:
            ids = _ints(blocks)
            self._slots_np[h:self.head] = ids
            self._pos_np[ids] = np.arange(h, self.head)
        self.head = h
        self.num_free += m

    def _recentre(self, room: int) -> None:
        """The queued blocks, in order and without holes, to the middle of the array, with at
        least `room` free entries at each end."""
        live = self.ids_array()
        cap = len(self._slots)
        if len(live) + 2 * room > cap:  # more than the array holds (not with vLLM's calls): grow it
            raise IntegrityError(f"free queue of {self.num_blocks} blocks asked to hold {len(live) + room}")
        start = (cap - len(live)) // 2
        self._slots_np[:] = -1
        self._slots_np[start:start + len(live)] = live
        self._pos_np[live] = np.arange(start, start + len(live))
        self.head, self.tail = start, start + len(live)

    def ids_array(self) -> np.ndarray:
        window = self._slots_np[self.head:self.tail]
        return window[window >= 0]

    def ids(self) -> list[int]:
        """Block ids from head to tail (O(queue); checks and tests)."""
        return self.ids_array().tolist()

    def __contains__(self, block: int) -> bool:
        return self._pos[block] >= 0


class Removed(NamedTuple):
    """A cached block evicted when reused: its hash, its block, the time from its caching to
    its eviction on the pool's clock, and the prefix hits it served."""

    block_hash: bytes
    block_id: int
    age: float = 0.0
    hits: int = 0


class BlockPool:
    """`num_blocks` blocks (block 0 the null block), the cached map and the free queue.

    Per block: `ref_cnt` (holders), `key` (its hash while cached; `has_key` the same as flags),
    `cached_at` (on the pool's clock) and `hits` (prefix hits since it was cached), each an
    array indexed by block id.

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
        self.ref_cnt = array("q", [0]) * num_blocks
        self._ref = np.frombuffer(self.ref_cnt, dtype=np.int64)
        self.hits = array("q", [0]) * num_blocks
        self._hits = np.frombuffer(self.hits, dtype=np.int64)
        self.cached_at = array("d", [0.0]) * num_blocks
        self._cached_at = np.frombuffer(self.cached_at, dtype=np.float64)
        self.has_key = bytearray(num_blocks)
        self._has_key = np.frombuffer(self.has_key, dtype=np.bool_)
        # A cached block's hash, where `has_key` says so (elsewhere a stale entry, never read):
        # gathered and scattered for many blocks at once in numpy.
        self.key = np.empty(num_blocks, dtype=object)
        self._marks = np.zeros(num_blocks, dtype=np.int64)  # scratch of `_distinct`
        self._dicts = 0  # entries of the map holding several blocks
        self.free = FreeQueue(num_blocks)
        # vLLM's map: a hash's one block, or, once a second block has that hash, {block: block}
        # in insertion order (the first inserted is served).
        self.cached: dict[bytes, Any] = {}
        self.null_block = self.free.popleft_n(1)[0]
        self.events: list = []
        # Evictions since the last drain, one column per field.
        self._evicted: tuple[list, array, array, array] = ([], array("q"), array("d"), array("q"))
        self.num_evicted = 0  # cached blocks evicted by reuse, since the pool was built
        self.num_cached = 0  # blocks holding a hash
        self.num_cached_free = 0  # of which in the free queue (evictable)
        self.clock: Callable[[], float] = lambda: 0.0
        # With a step check attached: the blocks each call changed (lists of ids; None: not kept).
        self.dirty: Optional[list] = None

    # -- lookups --------------------------------------------------------------------------
    def get_cached_block(self, block_hash: bytes) -> Optional[int]:
        found = self.cached.get(block_hash)
        if found is None or type(found) is int:
            return found
        return next(iter(found))

    def longest_cached(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest run of `hashes` from the first that are all cached
        (`get_cached_block` of each, up to the first miss), looked up in doubling slices."""
        get, found, at, step = self.cached.get, [], 0, 32
        while at < len(hashes):
            part = list(map(get, hashes[at:at + step]))
            if None in part:
                found += part[:part.index(None)]
                break
            found += part
            at += step
            step *= 2
        if dict in set(map(type, found)):  # a hash with several blocks: the first inserted
            found = [b if type(b) is int else next(iter(b)) for b in found]
        return found

    def cached_blocks(self) -> list[tuple[bytes, int]]:
        """(hash, block) of every entry of the map (O(map); checks and tests)."""
        return [(key, block) for key, entry in self.cached.items()
                for block in ((entry,) if type(entry) is int else entry)]

    def free_count(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are in the free queue (no holder), the null block aside."""
        if len(blocks) >= VECTOR_MIN:
            return int(np.count_nonzero(self._ref[_ints(blocks)] == 0)) - blocks.count(NULL_BLOCK)
        ref = self.ref_cnt
        return sum(1 for b in blocks if not ref[b] and b != NULL_BLOCK)

    @property
    def num_free_blocks(self) -> int:
        return self.free.num_free

    def usage(self) -> float:
        """vLLM's KV-cache usage: 1 - free / (blocks - null block)."""
        usable = self.num_blocks - 1
        return 1.0 - self.free.num_free / usable if usable else 0.0

    # -- hand-out, hits and frees ---------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[int]:
        if n > self.free.num_free:
            raise IntegrityError(f"cannot get {n} free blocks from a pool with {self.free.num_free} free")
        out = self.free.popleft_n(n)
        if self.dirty is not None:
            self.dirty.append(out)
        if n < VECTOR_MIN:
            ref, has_key, now = self.ref_cnt, self.has_key, None
            for block in out:
                if has_key[block]:
                    if now is None:  # the clock, read once: nothing moves it while blocks are handed out
                        now = self.clock()
                    self._evict_one(block, now)
                if ref[block]:
                    raise IntegrityError(f"block {block} was in the free queue with {ref[block]} holders")
                ref[block] = 1
            return out
        ids = _ints(out)
        hashed = self._has_key[ids]
        if hashed.any():
            self._evict(ids[hashed].tolist(), self.clock())
        held = self._ref[ids]
        if held.any():
            at = int(np.flatnonzero(held)[0])
            raise IntegrityError(f"block {out[at]} was in the free queue with {int(held[at])} holders")
        self._ref[ids] = 1
        return out

    def _distinct(self, ids: np.ndarray) -> bool:
        """No block twice in `ids` (O(len), no sort: each position marks its block, and a
        block given twice reads back its later position's mark)."""
        marks = self._marks
        order = np.arange(len(ids))
        marks[ids] = order
        return bool((marks[ids] == order).all())

    def _evict_one(self, block: int, now: float) -> None:
        """`_evict` of one block."""
        self.num_cached_free -= 1
        key = self.key[block]
        self.has_key[block] = 0
        cached = self.cached
        entry = cached.get(key)
        if entry is None:
            return
        if type(entry) is int:
            if entry != block:
                return
            del cached[key]
        else:
            if entry.pop(block, None) is None:
                return
            if not entry:
                del cached[key]
                self._dicts -= 1
        self.num_cached -= 1
        self.num_evicted += 1
        keys, ids, ages, hits = self._evicted
        keys.append(key)
        ids.append(block)
        ages.append(now - self.cached_at[block])
        hits.append(self.hits[block])
        if self.record_events:
            from memcli.mem_cache.kv_events import VllmBlockRemoved
            self.events.append(VllmBlockRemoved([external_hash(key)], MEDIUM_GPU))

    def _evict(self, blocks: list[int], now: float) -> None:
        """Cached free blocks handed out again leave the map (at time `now`, for their age),
        in order."""
        self.num_cached_free -= len(blocks)
        ids = _ints(blocks)
        keys = self.key[ids].tolist()
        cached = self.cached
        popped = list(map(cached.pop, keys, repeat(None))) if not self._dicts else None
        if popped == blocks:  # every hash has one block (no entry of several): each its block's, all leave
            removed, removed_keys = blocks, keys
        elif popped is not None:  # not with a consistent map: what was another block's goes back
            removed, removed_keys = [], []
            for block, key, entry in zip(blocks, keys, popped):
                if entry == block:
                    removed.append(block)
                    removed_keys.append(key)
                elif entry is not None:
                    cached[key] = entry
        else:
            removed, removed_keys = [], []
            for block, key in zip(blocks, keys):
                entry = cached.get(key)
                if entry is None:
                    continue
                if type(entry) is int:
                    if entry != block:
                        continue
                    del cached[key]
                else:
                    if entry.pop(block, None) is None:
                        continue
                    if not entry:
                        del cached[key]
                        self._dicts -= 1
                removed.append(block)
                removed_keys.append(key)
        self._has_key[ids] = False
        if not removed:
            return
        self.num_cached -= len(removed)
        self.num_evicted += len(removed)
        keys_col, ids, ages, hits = self._evicted
        keys_col += removed_keys
        ids.extend(removed)
        if len(removed) < VECTOR_MIN:
            cached_at, block_hits = self.cached_at, self.hits
            for block in removed:
                ages.append(now - cached_at[block])
                hits.append(block_hits[block])
        else:
            at = _ints(removed)
            ages.frombytes((now - self._cached_at[at]).tobytes())
            hits.frombytes(self._hits[at].tobytes())
        if self.record_events:
            from memcli.mem_cache.kv_events import VllmBlockRemoved
            self.events.extend(VllmBlockRemoved([external_hash(key)], MEDIUM_GPU) for key in removed_keys)

    @property
    def evicted(self) -> list[Removed]:
        """The evictions not yet drained, as records (oldest first)."""
        return [Removed(*fields) for fields in zip(*self._evicted)]

    def take_evicted(self) -> tuple[array, array]:
        """(ages, hits) of the evictions since the last call, oldest first; drains them."""
        _, _, ages, hits = self._evicted
        self._evicted = ([], array("q"), array("d"), array("q"))
        return ages, hits

    def touch(self, blocks: Sequence[int]) -> None:
        """A hit on `blocks` (distinct but for the null block): each gains a holder and a hit;
        those with none leave the free queue."""
        if self.dirty is not None:
            self.dirty.append(list(blocks))
        if len(blocks) < VECTOR_MIN or NULL_BLOCK in blocks:
            ref, hits, has_key, free = self.ref_cnt, self.hits, self.has_key, self.free
            for block in blocks:
                if block == NULL_BLOCK:
                    continue
                if not ref[block]:
                    free.remove(block)
                    self.num_cached_free -= has_key[block]
                ref[block] += 1
                hits[block] += 1
            return
        ids = _ints(blocks)
        idle = ids[self._ref[ids] == 0]
        if len(idle):
            self.free.remove_n(idle)
            self.num_cached_free -= int(np.count_nonzero(self._has_key[idle]))
        self._ref[ids] += 1
        self._hits[ids] += 1

    def free_blocks(self, ordered: Iterable[int]) -> None:
        """Blocks in eviction order (the first evicted first)."""
        ordered = list(ordered)
        if self.dirty is not None:
            self.dirty.append(ordered)
        if len(ordered) >= VECTOR_MIN and NULL_BLOCK not in ordered:
            ids = _ints(ordered)
            if self._distinct(ids):  # each once: every block's last decrement is its only one
                held = self._ref[ids] - 1
                if held.min() < 0:
                    raise IntegrityError(f"block {int(ids[np.flatnonzero(held < 0)[0]])} freed more often than it was held")
                self._ref[ids] = held
                idle = ids[held == 0]
                hashed = self._has_key[idle]
                if self.enable_caching:
                    self.free.prepend_n(idle[~hashed])
                    self.free.append_n(idle[hashed])
                    self.num_cached_free += int(np.count_nonzero(hashed))
                else:
                    self.free.prepend_n(idle)
                    self.num_cached_free += int(np.count_nonzero(hashed))
                return
        first, last = [], []
        to_first, to_last = first.append, (last if self.enable_caching else first).append
        ref, has_key = self.ref_cnt, self.has_key
        for block in ordered:
            if block == NULL_BLOCK:
                continue
            held = ref[block] - 1
            if held < 0:
                raise IntegrityError(f"block {block} freed more often than it was held")
            ref[block] = held
            if not held:
                (to_last if has_key[block] else to_first)(block)
        self.free.prepend_n(first)
        self.free.append_n(last)
        if self.enable_caching:
            self.num_cached_free += len(last)
        else:
            self.num_cached_free += sum(1 for b in first if has_key[b])

    # -- caching --------------------------------------------------------------------------
    def cache_full_blocks(self, blocks: list[int], hashes: Sequence[bytes], num_cached: int, num_full: int,
                          block_size: int, token_ids: Optional[Sequence[int]] = None,
                          first_extra: Optional[tuple] = None, event_block_size: Optional[int] = None) -> None:
        """Register `blocks[num_cached:num_full]` under `hashes[num_cached:num_full]`; with
        events on, one stored event for them (`token_ids`: the request's tokens; the event says
        `event_block_size`, None: `block_size`)."""
        if num_cached >= num_full:
            return
        now, cached = self.clock(), self.cached
        new_blocks, new_hashes = blocks[num_cached:num_full], hashes[num_cached:num_full]
        n = len(new_blocks)
        if self.dirty is not None:
            self.dirty.append(new_blocks)
        if n >= VECTOR_MIN and NULL_BLOCK not in new_blocks:
            ids = _ints(new_blocks)
            if self._has_key[ids].any():
                raise IntegrityError(f"block {int(ids[np.flatnonzero(self._has_key[ids])[0]])} is cached twice")
            if len(set(new_hashes)) == n and self._distinct(ids):
                # Hashes and blocks each once: a hash not in the map takes its block alone
                # (`setdefault` answers with the block); one that is there already (another
                # request's copy) is left to the loop below, as if met there in its turn.
                got = list(map(cached.setdefault, new_hashes, new_blocks))
                if got != new_blocks:
                    fresh = np.asarray([g is b for g, b in zip(got, new_blocks)], dtype=bool)
                    later = [(b, h) for b, h, f in zip(new_blocks, new_hashes, fresh.tolist()) if not f]
                    ids, new_hashes = ids[fresh], [h for h, f in zip(new_hashes, fresh.tolist()) if f]
                else:
                    later = ()
                keys = np.empty(len(ids), dtype=object)
                keys[:] = new_hashes
                self.key[ids] = keys
                self._has_key[ids] = True
                self._cached_at[ids] = now
                self._hits[ids] = 0
                self.num_cached += len(ids)
                if later:
                    self._cache_each(later, now)
                self._stored_event(blocks, hashes, num_cached, num_full, block_size, token_ids, first_extra,
                                   event_block_size)
                return
        self._cache_each(zip(new_blocks, new_hashes), now)
        self._stored_event(blocks, hashes, num_cached, num_full, block_size, token_ids, first_extra, event_block_size)

    def _cache_each(self, pairs: Iterable[tuple[int, bytes]], now: float) -> None:
        """`cache_full_blocks` block by block: (block, hash) pairs in order."""
        cached, key_of, has_key, cached_at, hits = self.cached, self.key, self.has_key, self.cached_at, self.hits
        for block, key in pairs:
            if block == NULL_BLOCK:
                continue
            if has_key[block]:
                raise IntegrityError(f"block {block} is cached twice")
            entry = cached.get(key)
            if entry is None:
                cached[key] = block
            elif type(entry) is int:
                if entry == block:
                    continue
                cached[key] = {entry: entry, block: block}
                self._dicts += 1
            elif block in entry:
                continue
            else:
                entry[block] = block
            key_of[block], has_key[block], cached_at[block], hits[block] = key, 1, now, 0
            self.num_cached += 1

    def _stored_event(self, blocks: list[int], hashes: Sequence[bytes], num_cached: int, num_full: int,
                      block_size: int, token_ids: Optional[Sequence[int]], first_extra: Optional[tuple],
                      event_block_size: Optional[int]) -> None:
        if not self.record_events:
            return
        from memcli.mem_cache.kv_events import VllmBlockStored
        new_hashes = [external_hash(hashes[i]) for i in range(num_cached, num_full) if blocks[i] != NULL_BLOCK]
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
        self.cached.clear()
        self._dicts = 0
        if self.dirty is not None:
            self.dirty.append(np.flatnonzero(self._has_key).tolist())
        self._has_key[:] = False
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
        problems = []
        queued = self.free.ids_array()
        times = np.bincount(queued, minlength=self.num_blocks)
        if len(queued) != self.free.num_free or (len(queued) and times.max() > 1):
            problems.append(f"free queue holds {len(queued)} links for {self.free.num_free} free blocks")
        in_queue = times[:self.num_blocks] > 0
        wrong = np.flatnonzero(in_queue[1:] != (self._ref[1:] == 0)) + 1
        for block in wrong[:8].tolist():
            problems.append(f"block {block}: {self.ref_cnt[block]} holders, in free queue: {bool(in_queue[block])}")
        entries = self.cached_blocks()
        cached = np.fromiter((block for _, block in entries), dtype=np.int64, count=len(entries))
        if len(cached) != self.num_cached or int(np.count_nonzero(self._ref[cached] == 0)) != self.num_cached_free:
            problems.append(f"cached-block counters {self.num_cached}/{self.num_cached_free} disagree with the map")
        hashes = np.empty(len(entries), dtype=object)
        hashes[:] = [key for key, _ in entries]
        if (not np.array_equal(np.sort(cached), np.flatnonzero(self._has_key))
                or (self.key[cached] != hashes).any()
                or self._dicts != list(map(type, self.cached.values())).count(dict)):
            problems.append("the map, the blocks' hashes and their flags disagree")
        if self.has_key[NULL_BLOCK] or in_queue[NULL_BLOCK]:
            problems.append("the map holds the null block, or the null block is queued")
        return problems[:8]
