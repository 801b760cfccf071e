"""Which request of a trace next uses a cached page: the future that Belady's eviction reads.

A page of the prefix cache is a position `e` (its last token is token `e - 1`) on a path of
tokens from the root. Request `j` *uses* it when its prompt starts with the path's first `e`
tokens and its match may reach that far (`e <= input_len - 1`: an engine computes at least
one token), so at admission it would match the page.

The cache asks through handles, so it never hands over whole paths:

    start(extra_key)          the handle of the empty path in that namespace
    advance(handle, tokens)   the handle of the path extended by `tokens`
    next_use(handle)          the first request, in trace order, that uses the page ending
                              at the handle and is not admitted yet (None: no such request)
    last_use(handle)          the last admitted request that uses it (None: none)

A handle is None once the path leaves every prompt of the trace (output tokens, or a prompt
that no other request shares beyond that point): nobody uses it.

`set_admitted(index, admitted)` moves the boundary between past and future: the replay marks
a request admitted when its first prefill batch is built, and not admitted again when it is
retracted (it will match its prefix again).

Two exact indexes, chosen by the trace format:

- Mooncake (`hash_ids`): a trie of hash blocks (keyed by parent and hash id, as the ceiling
  does). Token `k` of a block with hash `h` is `h * block_size + k`, so a handle is the trie
  block holding the path's last token and the path length; `advance` reads the block ids off
  the tokens and checks every token against them. Cost: O(blocks of the trace) to build.
- memcli token ids: every page end `e` (a multiple of the page size, up to the match cap) of
  every prompt, keyed by a 64-bit polynomial hash of the prompt's first `e` tokens (and the
  namespace); a handle is that hash and `e`. Cost: one entry per page of every prompt, so
  `MAX_PAGE_ENTRIES` bounds it.
"""

from __future__ import annotations

import hashlib
from array import array
from bisect import bisect_left, bisect_right
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from memcli.errors import MemcliError
from memcli.mem_cache.pages import align_down, whole_pages
from memcli.workload.spec import Trace

MAX_PAGE_ENTRIES = 40_000_000
_MASK = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15  # odd: invertible modulo 2**64
_BASE_INV = pow(_BASE, -1, 1 << 64)
_POS_MIX = 0xFF51AFD7ED558CCD
_SHORT = 16  # `_BlockFuture.advance` walks up to this many tokens in Python, more with numpy


class FutureTooLarge(MemcliError):
    """The index would take too much memory (a memcli-format trace with very many pages)."""


class FutureUses:
    """Past and future users of every page of a trace (see the module docstring)."""

    def __init__(self, num_requests: int, caps: np.ndarray, flat: Sequence[int] = ()):
        # The scalar lookups of an eviction's pair (`last_and_next_use`) read plain values:
        # `flat` (every page's users, the index's own order), the caps as an `array` and the
        # admitted flags as a bytearray. Each numpy read of one element, and each
        # searchsorted of a slice, cost more than the whole lookup does this way.
        self.caps = array("q", caps.tolist())  # per request: how far its match may reach (input_len - 1)
        self.admitted = bytearray(num_requests)  # per request: 1 while admitted
        self.frontier = 0  # every request before it is admitted
        self.max_admitted = -1
        self._flat = flat

    # -- the boundary between past and future ----------------------------------------------
    def set_admitted(self, index: int, admitted: bool) -> None:
        self.admitted[index] = admitted
        if admitted:
            self.max_admitted = max(self.max_admitted, index)
            n = len(self.admitted)
            while self.frontier < n and self.admitted[self.frontier]:
                self.frontier += 1
        else:
            self.frontier = min(self.frontier, index)

    def _first_future(self, lo: int, hi: int, pos: int) -> Optional[int]:
        """First user of `_flat[lo:hi]` (ascending) not admitted whose match reaches `pos`."""
        flat, admitted, caps = self._flat, self.admitted, self.caps
        for i in range(bisect_left(flat, self.frontier, lo, hi), hi):
            j = flat[i]
            if not admitted[j] and caps[j] >= pos:
                return int(j)
        return None

    def _last_past(self, lo: int, hi: int, pos: int) -> Optional[int]:
        """Last user of `_flat[lo:hi]` (ascending) admitted whose match reaches `pos`."""
        flat, admitted, caps = self._flat, self.admitted, self.caps
        for i in range(bisect_right(flat, self.max_admitted, lo, hi) - 1, lo - 1, -1):
            j = flat[i]
            if admitted[j] and caps[j] >= pos:
                return int(j)
        return None

    # -- implemented by the two indexes ------------------------------------------------------
    def start(self, extra_key: Optional[str]) -> Any:
        raise NotImplementedError

    def advance(self, handle: Any, tokens: np.ndarray) -> Any:
        raise NotImplementedError

    def users(self, handle: Any) -> Optional[tuple[np.ndarray, int]]:
        """The requests whose prompt holds the path of `handle` (ascending), and the position."""
        found = self._span(handle)
        return None if found is None else (np.asarray(self._flat[found[0]:found[1]], dtype=np.int64), found[2])

    def _span(self, handle: Any) -> Optional[tuple[int, int, int]]:
        """Where the users of `handle` sit in `_flat` (`lo`, `hi`), and the position; None
        when no prompt holds the path."""
        raise NotImplementedError

    def prompt_index(self, rid: str) -> Optional[int]:
        """The trace index of request `rid`, where `prompt_handle` can answer for it (None:
        ask `advance`)."""
        return None

    def prompt_handle(self, index: int, pos: int) -> Any:
        """`advance` from the start along the first `pos` (>= 1) tokens of request `index`'s
        prompt then outputs, without reading them: past its prompt a path holds output
        tokens, which no prompt of the trace holds (None)."""
        raise NotImplementedError

    def next_use(self, handle: Any) -> Optional[int]:
        found = self._span(handle) if handle is not None else None
        return None if found is None else self._first_future(*found)

    def last_use(self, handle: Any) -> Optional[int]:
        found = self._span(handle) if handle is not None else None
        return None if found is None else self._last_past(*found)

    def last_and_next_use(self, handle: Any) -> tuple[Optional[int], Optional[int]]:
        """(`last_use`, `next_use`) of `handle`, its users looked up once (an evicted leaf's pair)."""
        found = self._span(handle) if handle is not None else None
        return (None, None) if found is None else (self._last_past(*found), self._first_future(*found))


def check_future_fits(trace: Trace, page_size: int) -> None:
    """Raise `FutureTooLarge` when `build_future` would (before anything is built)."""
    if trace.format != "mooncake":
        _check_pages(sum(whole_pages(max(r.input_len - 1, 0), page_size) for r in trace.requests), page_size)


def _check_pages(pages: int, page_size: int) -> None:
    if pages > MAX_PAGE_ENTRIES:
        raise FutureTooLarge(
            f"the trace's future uses (for belady) need an index of {pages:,} pages, over the {MAX_PAGE_ENTRIES:,} kept",
            f"use a larger page size (now {page_size}) or replay fewer requests (--limit)")


def build_future(trace: Trace, page_size: int, kept: Optional[dict] = None) -> FutureUses:
    """The index of `trace` (Mooncake: block trie; memcli: pages of `page_size`). Raises
    `FutureTooLarge` when a memcli-format trace has more than `MAX_PAGE_ENTRIES` pages.

    `kept`: a dict that holds the read-only part of `trace`'s indexes (the trie, the page
    keys) between calls, for a process that replays one trace many times (a study's worker):
    each index is built once and every later future of `trace` shares it, with state of its own."""
    caps = np.fromiter((r.input_len - 1 for r in trace.requests), dtype=np.int64, count=trace.num_requests)
    kind = _BlockFuture if trace.format == "mooncake" else _PageFuture
    key = (kind.__name__, None if kind is _BlockFuture else page_size)
    index = None if kept is None else kept.get(key)
    if index is None:
        index = kind.index(trace, caps, page_size)
        if kept is not None:
            kept[key] = index
    return kind(trace.num_requests, caps, index)


class _BlockFuture(FutureUses):
    """Mooncake traces: a trie of hash blocks; a handle is (trie block, path length)."""

    def __init__(self, num_requests: int, caps: np.ndarray, index: dict):
        super().__init__(num_requests, caps, index["_flat"])
        self.__dict__.update(index)

    @staticmethod
    def index(trace: Trace, caps: np.ndarray, page_size: int) -> dict:
        """The read-only attributes of a future of `trace` (its trie), shared by its futures."""
        trie = block_trie(trace.requests)
        rids = {spec.rid: j for j, spec in enumerate(trace.requests)}
        return {
            # One user per block of every prompt (hundreds of thousands): 8 bytes each in an
            # `array` (a list would hold an int object for each), bisected as fast.
            "_flat": array("q", trie.flat.tolist()),
            "block_size": trace.block_size,
            "roots": trie.roots, "children": trie.children, "block_hash": trie.block_hash,
            "_starts": array("q", trie.starts.tolist()),
            # Each request's trie node at every block of its prompt, for `prompt_handle`.
            "paths": trie.paths, "path_starts": trie.path_starts,
            "input_lens": caps + 1,
            "rids": rids if len(rids) == trace.num_requests else {},  # ids that repeat answer nothing
        }

    def prompt_index(self, rid: str) -> Optional[int]:
        return self.rids.get(rid)

    def prompt_handle(self, index: int, pos: int) -> Any:
        if pos > self.input_lens[index]:
            return None
        return int(self.paths[self.path_starts[index] + (pos - 1) // self.block_size]), pos

    def start(self, extra_key: Optional[str]) -> Any:
        node = self.roots.get(extra_key)
        return None if node is None else (node, 0)

    def advance(self, handle: Any, tokens: np.ndarray) -> Any:
        if handle is None or len(tokens) == 0:
            return handle
        node, pos = handle
        bs, n = self.block_size, len(tokens)
        if n <= _SHORT:
            return self._advance_short(node, pos, tokens.tolist())
        # The path holds `tokens` when each block's tokens are consecutive from its offset:
        # token i is `id * bs + (pos + i) % bs`, one id per block. So the first token has the
        # path's offset, every step inside a block is +1, and each block start (a token at
        # offset 0) names the trie child; a head that finishes the path's block has its id.
        first = int(tokens[0])
        if first % bs != pos % bs:
            return None
        boundary = (-pos) % bs  # index of the first token opening a block
        steps = np.subtract(tokens[1:], tokens[:-1])
        if boundary == 0:
            steps[bs - 1::bs] = 1  # the steps into block starts bs, 2 bs, ... are not +1
        else:
            steps[boundary - 1::bs] = 1
            if first // bs != int(self.block_hash[node]):
                return None
        if np.count_nonzero(steps != 1):
            return None
        starts = tokens[boundary::bs]
        if len(starts):
            if np.count_nonzero(starts % bs):
                return None
            children = self.children
            for h in (starts // bs).tolist():
                node = children.get((node, h))
                if node is None:
                    return None
        return node, pos + n

    def _advance_short(self, node: int, pos: int, tokens: list[int]) -> Any:
        """`advance` token by token in Python, for the few tokens where numpy's per-call cost
        is all of it (an evicted node's first page): the same checks, the same handle."""
        bs, children, block = self.block_size, self.children, None
        for p, token in enumerate(tokens, pos):
            h, offset = divmod(token, bs)
            if offset != p % bs:
                return None
            if offset == 0:  # a new block: the trie's child for its id
                node = children.get((node, h))
                if node is None:
                    return None
                block = h
            elif block is None:  # the first tokens finish the block the path is in
                block = int(self.block_hash[node])
                if h != block:
                    return None
            elif h != block:
                return None
        return node, pos + len(tokens)

    def _span(self, handle: Any) -> Optional[tuple[int, int, int]]:
        node, pos = handle
        return self._starts[node], self._starts[node + 1], pos


class _PageFuture(FutureUses):
    """memcli traces: every page end of every prompt, by the hash of the prompt up to it."""

    def __init__(self, num_requests: int, caps: np.ndarray, index: dict):
        super().__init__(num_requests, caps, index["_flat"])
        self.__dict__.update(index)

    @staticmethod
    def index(trace: Trace, caps: np.ndarray, page_size: int) -> dict:
        """The read-only attributes of a future of `trace` at `page_size` (the page keys),
        shared by its futures."""
        _check_pages(sum(whole_pages(max(int(c), 0), page_size) for c in caps.tolist()), page_size)
        keys, owners = [], []
        for j, req in enumerate(trace.requests):
            cap = align_down(int(caps[j]), page_size)
            if cap <= 0:
                continue
            ends = np.arange(page_size, cap + 1, page_size, dtype=np.int64)
            hashes = _prefix_hashes(req.input_ids()[:cap], _seed(req.extra_key))[ends - 1]
            keys.append(_mix(hashes, ends))
            owners.append(np.full(len(ends), j, dtype=np.int64))
        key = np.concatenate(keys) if keys else np.empty(0, dtype=np.uint64)
        owner = np.concatenate(owners) if owners else np.empty(0, dtype=np.int64)
        order = np.lexsort((owner, key))
        key, flat = key[order], owner[order]  # `_flat`: numpy (up to `MAX_PAGE_ENTRIES`)
        keys, first = np.unique(key, return_index=True)
        return {"_flat": flat, "page_size": page_size, "keys": keys, "starts": np.append(first, len(key)).astype(np.int64)}

    def start(self, extra_key: Optional[str]) -> Any:
        return _seed(extra_key), 0

    def advance(self, handle: Any, tokens: np.ndarray) -> Any:
        value, pos = handle
        n = len(tokens)
        if n == 0:
            return handle
        powers = _powers(n)
        body = int(np.multiply(tokens.astype(np.uint64) + np.uint64(1), powers[n - 1::-1]).sum(dtype=np.uint64))
        return (value * pow(_BASE, n, 1 << 64) + body) & _MASK, pos + n

    def _span(self, handle: Any) -> Optional[tuple[int, int, int]]:
        value, pos = handle
        if pos == 0 or pos % self.page_size:
            return None
        key = _mix(np.asarray([value], dtype=np.uint64), np.asarray([pos], dtype=np.int64))[0]
        i = int(np.searchsorted(self.keys, key))
        if i == len(self.keys) or self.keys[i] != key:
            return None
        return int(self.starts[i]), int(self.starts[i + 1]), pos


class BlockTrie(NamedTuple):
    """The trie of a Mooncake trace's hash blocks. Node 0 is unused; each namespace
    (`extra_key`) has a root; nodes are numbered in the order a walk of the requests in trace
    order, block by block, first reaches them."""

    roots: dict  # extra_key -> root node
    children: dict  # (parent node, hash id) -> child node
    block_hash: np.ndarray  # per node: its block's hash id (-1 for node 0 and the roots)
    starts: np.ndarray  # per node: where its users begin in `flat` (one more entry at the end)
    flat: np.ndarray  # the users of every node, node by node, each node's in trace order
    paths: np.ndarray  # every request's node at each of its blocks, request by request
    path_starts: np.ndarray  # per request: where its nodes begin in `paths`


def block_trie(requests: Sequence[Any]) -> BlockTrie:
    """The `BlockTrie` of `requests` (each with `hash_ids` and `extra_key`), built one depth
    at a time over all requests at once: a node is a distinct (parent, hash id) pair."""
    lengths = np.fromiter((len(r.hash_ids) for r in requests), dtype=np.int64, count=len(requests))
    hashes = np.fromiter((h for r in requests for h in r.hash_ids), dtype=np.int64, count=int(lengths.sum()))
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    names = {}
    space = np.fromiter((names.setdefault(r.extra_key, len(names)) for r in requests), dtype=np.int64,
                        count=len(requests))
    # One int64 key per (parent, hash id): the parent times the number of distinct ids, plus the id's rank.
    distinct, rank = np.unique(hashes, return_inverse=True)
    span = max(len(distinct), 1)
    # Every node as (first request, depth, parent, hash rank); the roots at depth -1.
    first_j = [np.unique(space, return_index=True)[1]]
    depth, parent_key, hash_rank = [np.full(len(names), -1)], [np.full(len(names), -1)], [np.full(len(names), -1)]
    node = space.copy()  # each request's node at the current depth (provisional ids: roots first)
    paths = np.empty(len(hashes), dtype=np.int64)  # the same, at every block
    count, alive = len(names), np.arange(len(requests))
    for d in range(int(lengths.max(initial=0))):
        alive = alive[lengths[alive] > d]
        keys, first, inverse = np.unique(node[alive] * span + rank[offsets[alive] + d], return_index=True,
                                         return_inverse=True)
        node[alive] = count + inverse.reshape(-1)
        paths[offsets[alive] + d] = node[alive]
        first_j.append(alive[first])
        depth.append(np.full(len(keys), d))
        parent_key.append(keys // span)
        hash_rank.append(keys % span)
        count += len(keys)
    # Renumber in first-reach order: by first request, then depth (node 0 stays unused).
    order = np.lexsort((np.concatenate(depth), np.concatenate(first_j)))
    new_id = np.empty(count, dtype=np.int64)
    new_id[order] = np.arange(1, count + 1)
    kids = np.arange(len(names), count)
    parents, hash_ids = np.concatenate(parent_key)[kids], distinct[np.concatenate(hash_rank)[kids]]
    block_hash = np.full(count + 1, -1, dtype=np.int64)
    block_hash[new_id[kids]] = hash_ids
    children = dict(zip(zip(new_id[parents].tolist(), hash_ids.tolist()), new_id[kids].tolist()))
    roots = {name: int(new_id[i]) for name, i in names.items()}
    # The users of each node: the requests whose paths pass it, in trace order.
    path_nodes = new_id[paths]
    user = np.repeat(np.arange(len(requests), dtype=np.int64), lengths)
    by_node = np.lexsort((user, path_nodes))
    starts = np.zeros(count + 2, dtype=np.int64)
    np.cumsum(np.bincount(path_nodes, minlength=count + 1), out=starts[1:])
    return BlockTrie(roots, children, block_hash, starts, user[by_node], path_nodes, offsets[:-1])


def _seed(extra_key: Optional[str]) -> int:
    if extra_key is None:
        return 0
    return int.from_bytes(hashlib.blake2b(extra_key.encode(), digest_size=8).digest(), "little")


_POWER_TABLES: dict[int, np.ndarray] = {}


def _power_table(base: int, n: int) -> np.ndarray:
    """base**i mod 2**64 for i < n (at least), kept per base and doubled as longer paths come."""
    table = _POWER_TABLES.get(base)
    if table is None or len(table) < n:
        size = max(n, 2 * (0 if table is None else len(table)), 1)
        table = np.empty(size, dtype=np.uint64)
        value = 1
        for i in range(size):  # once per process, up to the longest path seen
            table[i] = value
            value = value * base & _MASK
        _POWER_TABLES[base] = table
    return table


def _powers(n: int) -> np.ndarray:
    """BASE**i mod 2**64 for i < n (at least)."""
    return _power_table(_BASE, n)


def _inverse_powers(n: int) -> np.ndarray:
    """BASE**-i mod 2**64 for i < n (at least)."""
    return _power_table(_BASE_INV, n)


def _prefix_hashes(tokens: np.ndarray, seed: int) -> np.ndarray:
    """H[k] = hash of tokens[:k + 1] with `advance`'s polynomial: seed * B^(k+1) + sum (t_i + 1) B^(k-i)."""
    n = len(tokens)
    powers = _powers(n + 1)
    inverse = _inverse_powers(n)
    scaled = np.multiply(tokens.astype(np.uint64) + np.uint64(1), inverse[:n])
    sums = np.cumsum(scaled, dtype=np.uint64)  # sum (t_i + 1) B^-i, wrapping
    out = np.multiply(sums, powers[:n])  # times B^k
    if seed:
        out += np.uint64(seed) * powers[1:n + 1]
    return out


def _mix(hashes: np.ndarray, ends: np.ndarray) -> np.ndarray:
    return hashes ^ (ends.astype(np.uint64) * np.uint64(_POS_MIX))
