"""Page-aware radix tree of cached KV slots (SGLang's RadixCache, vectorised).

Each edge into a node stores a run of token ids (`node.key`, a numpy int64 array) and the
KV slots that hold them (`node.value`, an int64 tensor on the cache's device). Children
are found by a per-page key (the first token when page_size == 1, the bytes of the first
page otherwise, prefixed by `extra_key` when set); where a query leaves a node is found
with one vectorised comparison, floored to a page. Every key and value length in the tree
is a multiple of page_size.

Locks are path based: `inc_lock_ref(node)` counts one holder on every node from `node` up
to the root. Tokens in nodes with `lock_ref == 0` are evictable, the rest protected.
Eviction frees whole leaves in priority order (see `eviction.py`) from a queue kept
across calls.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np
import torch

from memcli.check_result import IntegrityReport
from memcli.errors import IntegrityError
from memcli.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult, RadixKey
from memcli.mem_cache.eviction import EvictionQueue, get_eviction_policy, is_evictable_leaf
from memcli.mem_cache.integrity.owners import TREE
from memcli.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, chain_page_hashes, stored_events
from memcli.mem_cache.pages import align_down
from memcli.mem_cache.req_kv import PrefixStore
from memcli.mem_cache.tree_checks import TreeView, radix_checks

_EMPTY_TOKENS = np.empty((0,), dtype=np.int64)
_UNKNOWN = object()  # a handle not computed yet (None is the future's "nobody uses it")


class EvictionRecord(NamedTuple):
    """One evicted node: its size, how long it was cached, how often it was matched, and,
    when the cache knows the trace's future (`RadixCache.future`), the requests (trace
    indices, -1 for none) that last used and will next use its first page."""

    tokens: int
    age: float
    hit_count: int
    last_use: int = -1
    next_use: int = -1


def _request_key(req: Any, tokens: np.ndarray) -> RadixKey:
    """The key of `tokens`, a prefix of `req`'s token ids: its namespace, and its id as the
    origin (`RadixKey.origin`) where it has one."""
    return RadixKey(tokens, req.extra_key, getattr(req, "rid", None))


def _leaf_tokens(tokens: np.ndarray, start: int, end: int) -> np.ndarray:
    """A new leaf's key, `tokens[start:end]`: a view when it covers at least half of the
    array the tokens live in (a prompt, or a request's prompt-and-outputs buffer, neither
    ever rewritten), else a compact copy, so that the keys never keep more than twice the
    tree's tokens alive (the rule `RadixCache.insert` applies to keys and slots)."""
    whole = tokens if tokens.base is None else tokens.base
    leaf = tokens[start:end]
    if not isinstance(whole, np.ndarray) or 2 * (end - start) < whole.size:
        return leaf.copy()
    return leaf


class _Slots(NamedTuple):
    """An insert's slots for the tokens [start, start + len(value)) of its key."""

    value: torch.Tensor
    start: int

    def get(self, begin: int, end: int) -> torch.Tensor:
        """The slots of the tokens [begin, end); raises IntegrityError before `start` (a
        request's locked prefix, whose slots the insert was not given)."""
        if begin < self.start:
            raise IntegrityError(f"insert: the slots of tokens {begin}..{end} were asked for, but the insert holds"
                                 f" only those from {self.start} (the request's locked prefix is the tree's)")
        return self.value[begin - self.start : end - self.start]


class TreeNode:
    """One edge of the radix tree: `key` tokens whose KV sits in `value` slots."""

    __slots__ = (
        "children", "parent", "key", "value", "extra_key", "lock_ref",
        "creation_time", "last_access_time", "birth_time", "hit_count", "page_hashes", "heap_seq", "id",
        "future_end", "future_first", "origin",
    )
    _ids = itertools.count()

    def __init__(self, parent: Optional["TreeNode"], key: np.ndarray, value: torch.Tensor,
                 extra_key: Optional[str], last_access: float, created: float, birth: float):
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value: Optional[torch.Tensor] = value  # None once evicted
        self.extra_key = extra_key
        self.lock_ref = 0
        self.last_access_time = last_access  # stamps that order eviction (see RadixCache)
        self.creation_time = created
        self.birth_time = birth  # on the caller's clock: eviction ages are measured from it
        self.hit_count = 0
        self.page_hashes: list[int] = []  # only filled when KV events are on
        self.heap_seq = -1
        self.id = next(TreeNode._ids)
        self.future_end = _UNKNOWN  # the future's handles of the path to this node's end and first page
        self.future_first = _UNKNOWN
        self.origin: Optional[str] = None  # a request whose tokens the path root -> here holds (RadixKey.origin)

    @property
    def evicted(self) -> bool:
        return self.value is None

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, hits={self.hit_count})"


class RadixCache(BasePrefixCache):
    """Prefix cache over a paged (or token) KV allocator.

    `clock` (zero-argument callable, default `time.monotonic`) is the time of the caller
    (a simulated clock in replays): eviction ages are measured on it. The stamps that order
    eviction (`last_access_time`, `creation_time`) come from it too with
    `lru_clock="simulated"` (one time per operation), or from a logical clock (1.0, 2.0, ...) that ticks
    at every stamp with `lru_clock="logical"` (one reading per node, in SGLang's order: a
    new node reads it twice, access then creation). `split_stamp="refresh"` stamps a node
    before splitting it and creates the upper node fresh (SGLang); `"keep"` gives the upper
    node the old node's times and hit count, and leaves the tail's. `count_hits=False`
    never counts hits (SGLang's plain radix cache: LFU then orders as LRU).
    `retract_free="two_calls"` frees a retracted request's aligned part and its partial last
    page in two allocator calls (SGLang: the pages of the second call are handed out first).
    `eviction_log` receives an `EvictionRecord` per evicted node; the caller clears it.

    `future` (set by the caller; see `memcli.workload.future`) answers which request of the
    trace next uses a node's first page. `eviction_policy="belady"` needs it: the evictable
    leaf whose first page is next used furthest in the future goes first (never used again
    before anything), Belady's rule applied to the tree's leaves; and with it every
    `EvictionRecord` carries the last and next use of what was evicted.
    """

    def __init__(self, req_to_token_pool: Any, allocator: Any, page_size: int,
                 eviction_policy: str = "lru", kv_events: bool = False,
                 device: Optional[torch.device | str] = None, disable: bool = False,
                 lru_clock: str = "simulated", split_stamp: str = "keep", count_hits: bool = True,
                 retract_free: str = "one_call", tree_stamps: str = "radix", insert_hits: bool = False,
                 free_order: str = "sorted", prompt_split: str = "none"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.req_to_token_pool = req_to_token_pool
        self._table: Optional[torch.Tensor] = None  # the pool's table and, on a CPU, its numpy view (`_row`)
        self._table_host: Optional[np.ndarray] = None
        self.allocator = allocator
        self.page_size = page_size
        self.eviction_policy = eviction_policy.lower()
        self.priority = get_eviction_policy(eviction_policy)
        self.belady = self.eviction_policy == "belady"
        if self.belady:
            self.priority = self._belady_priority
        self.future = None
        self.kv_events = kv_events
        self.disable = disable
        if device is None:
            device = allocator.device if allocator is not None else "cpu"
        self.device = torch.device(device)
        self.clock: Callable[[], float] = time.monotonic
        if lru_clock not in ("simulated", "logical") or split_stamp not in ("keep", "refresh"):
            raise ValueError(f"lru_clock {lru_clock!r} / split_stamp {split_stamp!r}: unknown")
        if lru_clock == "logical":
            # `_stamp` reads a logical clock (1.0, 2.0, ..., `LogicalClock`'s reads) without a
            # Python frame per stamp: a replay stamps a node about twenty times per request.
            self._stamp = functools.partial(next, itertools.count(1.0))
        self.refresh_split = split_stamp == "refresh"
        self.count_hits = count_hits
        self.retract_free_twice = retract_free == "two_calls"
        if tree_stamps not in ("radix", "unified") or free_order not in ("sorted", "row"):
            raise ValueError(f"tree_stamps {tree_stamps!r} / free_order {free_order!r}: unknown")
        self.unified = tree_stamps == "unified"
        self.insert_hits = insert_hits
        self._segment = {"segment": True} if free_order == "row" else {}  # allocator.free's keyword
        self.split_prompt = prompt_split == "prompt"  # 0.5.23's checkpoint (tree_stamps="unified" only)
        self._now = 0.0  # the current operation's time on `clock`
        self.eviction_log: list[EvictionRecord] = []
        self.evicted_tokens_total = 0  # every token `evict` ever freed (never reset)
        self._events: list = []
        self._new_tree()

    def reset(self) -> None:
        """Empty tree (root only, permanently locked). Slots are not returned to the allocator.

        Call it only when no request holds a node: nodes of the old tree cannot be unlocked.
        """
        self._new_tree()
        if self.kv_events:
            self._events.append(AllBlocksCleared())

    def _begin(self) -> float:
        """Start an operation: read the caller's clock once."""
        self._now = self.clock()
        return self._now

    def _stamp(self) -> float:
        """One access or creation stamp: the operation's time (with the logical clock, the
        instance's own `_stamp` gives the clock's next tick instead)."""
        return self._now

    def _node(self, parent: Optional[TreeNode], key: np.ndarray, value: torch.Tensor,
              extra_key: Optional[str], birth: float) -> TreeNode:
        last_access = self._stamp()
        return TreeNode(parent, key, value, extra_key, last_access, self._stamp(), birth)

    def _new_tree(self) -> None:
        self.root = self._node(None, _EMPTY_TOKENS, self.empty_indices(), None, self._begin())
        self.root.lock_ref = 1
        self._total = 0
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        self._queue = EvictionQueue(self.priority)

    # -- sizes --------------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._total

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, root excluded."""
        return self._num_nodes

    # -- match and insert ---------------------------------------------------------------

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached page-aligned prefix of `key`.

        Counts a hit and refreshes the access time on every node the match passes through;
        splits at most one node. A key shorter than one page matches nothing.
        """
        walked = self._match_walk(key)
        if walked is None:
            return MatchResult(self.empty_indices(), self.root)
        node, values = walked
        return MatchResult(self._cat(values), node)

    def touch_prefix(self, key: RadixKey) -> None:
        """`match_prefix`'s walk, stamps and splits, without joining the matched nodes' slots."""
        self._match_walk(key)

    def _match_walk(self, key: RadixKey) -> Optional[tuple[TreeNode, list]]:
        """A match's walk (stamps, hits, the split) and requeue: (the last node, the values of
        the nodes passed), or None when the key matches nothing without a walk."""
        aligned = len(key) - len(key) % self.page_size
        if self.disable or aligned == 0:
            return None
        self._begin()
        if self.unified:
            node, _, values = self._walk_unified(key.token_ids[:aligned], key.extra_key)
            self._stamp_path(node)
        else:
            node, _, values = self._walk(key.token_ids[:aligned], key.extra_key, count_hit=True)
        self._touched(node)
        return node, values

    def _insert_input(self, key: RadixKey, value: Optional[torch.Tensor], value_start: int = 0):
        """(tokens, slots, page-aligned length) of an insert, or None when nothing is inserted
        (the cache is disabled, or the key holds no whole page). `value` holds the slots of
        tokens [value_start, len(key)); `value=None` stores the token ids as slots (tests).
        Raises ValueError when key and value differ in length."""
        if self.disable:
            return None
        tokens = key.token_ids
        if value is None:
            value = torch.as_tensor(tokens[value_start:], dtype=torch.int64, device=self.device)
        if value.shape[0] != len(tokens) - value_start:
            raise ValueError(f"insert: key has {len(tokens)} tokens past {value_start} but value has"
                             f" {value.shape[0]} slots")
        aligned = len(tokens) - len(tokens) % self.page_size
        return None if aligned == 0 else (tokens, value, aligned)

    def insert(self, key: RadixKey, value: Optional[torch.Tensor] = None, chunked: bool = False,
               on_path: int = 0) -> int:
        """See `BasePrefixCache.insert`. `value=None` stores the token ids as slots (tests).
        `chunked` (a non-final prefill chunk) changes nothing here (see `HiRadixCache`).
        `on_path`: the key's first tokens known to be the tree's along the walk (`_walk`).

        Refreshes access times along the path (no hit counted). The new leaf views the
        caller's arrays when it covers at least half of them, else stores compact copies,
        so the tree never keeps more than twice its own size alive.
        """
        prepared = self._insert_input(key, value)
        if prepared is None:
            return 0
        tokens, value, aligned = prepared
        now = self._begin()
        node, prefix_len, _ = self._walk(tokens[:aligned], key.extra_key, count_hit=False, on_path=on_path)
        if prefix_len < aligned:
            leaf_key, leaf_value = tokens[prefix_len:aligned], value[prefix_len:aligned]
            if leaf_value.dtype != torch.int64 or leaf_value.device != self.device:
                leaf_value = leaf_value.to(self.device, torch.int64)
            if 2 * (aligned - prefix_len) < len(tokens):
                # A short view would keep the caller's whole array alive: store a compact copy.
                leaf_key, leaf_value = leaf_key.copy(), leaf_value.clone()
            node = self._add_leaf(node, leaf_key, leaf_value, key.extra_key, now, key.origin)
        self._touched(node)
        return prefix_len

    def _walk(self, tokens: np.ndarray, extra_key: Optional[str],
              count_hit: bool, on_path: int = 0) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Descend along page-aligned `tokens`, splitting the node where they leave it.

        Stamps every node it passes (see the class docstring for the order). Returns the
        deepest node reached, the number of tokens matched, and the values of the nodes
        passed (in order). `tokens[:on_path]` are known to be the tree's along this path (a
        locked prefix, or a key just inserted): a node ending inside them is matched whole
        without comparing its tokens (the walk is the compare's, as in `insert_unified`).
        """
        node, pos, values = self.root, 0, []
        node.last_access_time = self._stamp()
        while pos < len(tokens):
            child = node.children.get(self._child_key(extra_key, tokens, pos))
            if child is None:
                break
            child_len = len(child.key)
            matched = self._matched(child.key, tokens, pos, on_path)
            if matched < child_len and self.refresh_split:
                child.last_access_time = self._stamp()
                child = self._split(child, matched)
            else:
                if matched < child_len:
                    child = self._split(child, matched)
                child.last_access_time = self._stamp()
            if self.count_hits:
                child.hit_count += count_hit
            values.append(child.value)
            node, pos = child, pos + matched
            if matched < child_len:
                break
        return node, pos, values

    # -- SGLang 0.5.23's UnifiedTreeCore (tree_stamps="unified") -------------------------

    def _walk_unified(self, tokens: np.ndarray, extra_key: Optional[str]) -> tuple[TreeNode, int, list]:
        """A match's descent: no stamps, except those of a split where `tokens` leave a node."""
        node, pos, values = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(self._child_key(extra_key, tokens, pos))
            if child is None:
                break
            matched = self._common_len(child.key, tokens[pos : pos + len(child.key)])
            split = matched < len(child.key)
            if split:
                child = self._split_unified(child, matched)
            values.append(child.value)
            node, pos = child, pos + matched
            if split:
                break
        return node, pos, values

    def _stamp_path(self, node: TreeNode) -> None:
        """The end of a match: one fresh tick for `node`, each step toward the root 1e-5 older."""
        now = self._stamp()
        while node is not None:
            node.last_access_time = now
            now -= 0.00001
            node = node.parent

    def _split_unified(self, child: TreeNode, split_len: int) -> TreeNode:
        """0.5.23's split: a new upper node (stamped as new) that keeps `child`'s creation time
        and hit count; then the tail is restamped."""
        upper = self._split(child, split_len, fresh=True)
        upper.creation_time, upper.hit_count, upper.birth_time = child.creation_time, child.hit_count, child.birth_time
        child.last_access_time = self._stamp()
        return upper

    def insert_unified(self, key: RadixKey, value: torch.Tensor, prev_prefix_len: int = 0,
                       inserted_len: int = 0, owner: Any = None, value_start: int = 0,
                       owned: bool = False, on_path: int = 0) -> tuple[int, TreeNode]:
        """0.5.23's insert walk: stamps the root and each node it walks, counts a hit (with
        `insert_hits`) on each node ending past `inserted_len`, and itself frees the slots of
        `value` that duplicate the tree past `prev_prefix_len` (one free per node, in walk
        order; `owner` is the request row they come from). Returns (prefix length, last node).

        `value` holds the slots of the tokens [value_start, len(key)) only: a request's
        locked prefix (value_start <= prev_prefix_len) is the tree's already, so its slots
        are never read. `owned`: `value` is the caller's to give away (a copy nobody else
        holds), so a new leaf may keep a view of it instead of a copy. `on_path`: the key's first
        `on_path` tokens are known to be the tree's, along the path the walk takes (a locked
        prefix, or what an insert of the same key just walked), so a node the walk passes
        inside them is taken as matched whole without comparing its tokens: the walk, its
        stamps, splits and frees are those of the compare."""
        prepared = self._insert_input(key, value, value_start)
        if prepared is None:
            return 0, self.root
        tokens, value, aligned = prepared
        if value_start > prev_prefix_len:
            raise ValueError(f"insert_unified: slots start at {value_start}, past the prefix {prev_prefix_len}")
        slots = _Slots(value, value_start)
        tokens = tokens[:aligned]
        now = self._begin()
        node, pos = self.root, 0
        node.last_access_time = self._stamp()
        while pos < aligned:
            child = node.children.get(self._child_key(key.extra_key, tokens, pos))
            if child is None:
                break
            child.last_access_time = self._stamp()
            child_len = len(child.key)
            matched = self._matched(child.key, tokens, pos, on_path)
            if matched < child_len:
                child = self._split_unified(child, matched)
            self._insert_walked(child, slots, pos, matched, prev_prefix_len, owner)
            if pos + matched > inserted_len:
                self._count_insert_hit(child)
            node, pos = child, pos + matched
        if pos < aligned:
            leaf_value = slots.get(pos, aligned)
            if leaf_value.dtype != torch.int64 or leaf_value.device != self.device:
                leaf_value = leaf_value.to(self.device, torch.int64)
            if not owned or 2 * (aligned - pos) < value.shape[0]:
                leaf_value = leaf_value.clone()  # a short view would keep the caller's whole array alive
            node = self._add_leaf(node, _leaf_tokens(tokens, pos, aligned), leaf_value, key.extra_key, now, key.origin)
            if aligned > inserted_len:
                self._count_insert_hit(node)
        self._touched(node)
        return pos, node

    def _insert_walked(self, child: TreeNode, slots: "_Slots", pos: int, matched: int,
                       prev_prefix_len: int, owner: Any) -> None:
        """The insert walk reached `child`, which already holds the tokens [pos, pos + matched)
        of the insert: the request's duplicate slots past `prev_prefix_len` are freed."""
        start = max(prev_prefix_len, pos)
        if start < pos + matched:
            self._free(slots.get(start, pos + matched), owner, "insert")

    def _count_insert_hit(self, node: TreeNode) -> None:
        """A hit counted on insert (0.5.23's `lfu_hits: insert`)."""
        if self.insert_hits:
            node.hit_count += 1

    def _child_key(self, extra_key: Optional[str], tokens: np.ndarray, pos: int) -> Any:
        if self.page_size == 1:
            plain = int(tokens[pos])
        else:
            plain = tokens[pos : pos + self.page_size].tobytes()
        return plain if extra_key is None else (extra_key, plain)

    def _matched(self, node_key: np.ndarray, tokens: np.ndarray, pos: int, on_path: int) -> int:
        """The tokens of a node with `node_key` that `tokens[pos:]` match: the whole node when it
        ends within `tokens[:on_path]` (known to be the tree's along this walk), else compared."""
        n = len(node_key)
        if pos + n <= on_path:
            return n
        return self._common_len(node_key, tokens[pos : pos + n])

    def _common_len(self, node_key: np.ndarray, tokens: np.ndarray) -> int:
        """Equal leading tokens of `node_key` and `tokens` (len <= len(node_key)), floored to a page."""
        n = len(tokens)
        differs = node_key[:n] != tokens
        first = int(differs.argmax()) if n else 0
        if n and differs[first]:
            n = first
        return n - n % self.page_size

    def _split(self, child: TreeNode, split_len: int, fresh: Optional[bool] = None) -> TreeNode:
        """Insert a node holding `child`'s first `split_len` tokens above it; return it.

        The upper node inherits the lock count; with `refresh_split` it is a new node (new
        stamps, no hits), else it inherits `child`'s stamps and hit count. Sizes do not change.
        """
        parent = child.parent
        if self.refresh_split if fresh is None else fresh:
            upper = self._node(parent, child.key[:split_len], child.value[:split_len], child.extra_key, self._now)
        else:
            upper = TreeNode(parent, child.key[:split_len], child.value[:split_len], child.extra_key,
                             child.last_access_time, child.creation_time, child.birth_time)
            upper.hit_count = child.hit_count
        upper.lock_ref, upper.origin = child.lock_ref, child.origin
        pages = split_len // self.page_size
        upper.page_hashes, child.page_hashes = child.page_hashes[:pages], child.page_hashes[pages:]
        parent.children[self._child_key(child.extra_key, child.key, 0)] = upper
        child.key, child.value, child.parent = child.key[split_len:], child.value[split_len:], upper
        child.future_first = _UNKNOWN
        upper.children[self._child_key(child.extra_key, child.key, 0)] = child
        self._num_nodes += 1
        if self.belady and is_evictable_leaf(child):
            self._queue.push(child)  # its first page moved: its next use can only be later
        return upper

    def _add_leaf(self, parent: TreeNode, key: np.ndarray, value: torch.Tensor,
                  extra_key: Optional[str], now: float, origin: Optional[str] = None) -> TreeNode:
        leaf = self._node(parent, key, value, extra_key, now)
        leaf.origin = origin
        parent.children[self._child_key(extra_key, key, 0)] = leaf
        self._total += len(key)
        self._evictable += len(key)
        self._num_nodes += 1
        if self.kv_events:
            parent_hash = parent.page_hashes[-1] if parent.page_hashes else None
            leaf.page_hashes = chain_page_hashes(parent_hash, extra_key, key, self.page_size)
            self._events.extend(stored_events(parent_hash, extra_key, key, leaf.page_hashes, self.page_size))
        return leaf

    def _touched(self, node: TreeNode) -> None:
        """Re-queue `node` if it is an evictable leaf (its priority may have changed)."""
        if is_evictable_leaf(node):
            self._queue.push(node)
            if len(self._queue) > 4 * self._num_nodes + 1024:
                self._queue.rebuild(n for n in self._iter_nodes() if is_evictable_leaf(n))

    def _cat(self, values: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(values) if values else self.empty_indices()

    def _row(self, row_id: int) -> "torch.Tensor | np.ndarray":
        """Request row `row_id` of the pool's table: on a CPU a numpy view of it (indexing the
        table's tensor costs ten times more), else the tensor's row."""
        table = self.req_to_token_pool.req_to_token
        if table is not self._table:
            self._table, self._table_host = table, (table.numpy() if table.is_cpu else None)
        host = self._table_host
        return table[row_id] if host is None else host[row_id]

    @staticmethod
    def _row_slots(row: "torch.Tensor | np.ndarray", start: int, end: int) -> torch.Tensor:
        """`row[start:end].to(torch.int64)`: a request row's slots (`_row`) as a new int64 tensor."""
        if isinstance(row, np.ndarray):
            return torch.from_numpy(row[start:end].astype(np.int64))
        return row[start:end].to(torch.int64)

    def _next_prefix(self, req: Any, row: "torch.Tensor | np.ndarray", row_id: int, unchanged: int,
                     up_to: int) -> torch.Tensor:
        """A checkpoint's prefix for the next round: `_row_slots(row, 0, up_to)`, the row's first
        `up_to` slots as a new int64 tensor. On a CPU it is read into the request's
        `PrefixStore`: when the prefix the request holds is the store's last view and the row
        kept its slots (none of its first `len(prefix)` positions rewritten: all below
        `unchanged`), only the row past that prefix is cast; else the whole row, into a new
        store (room for the prompt, which every later chunk of it fits), or for a prefix that
        is the whole prompt already (no chunk follows) into a tensor of its own."""
        if not isinstance(row, np.ndarray):
            return self._row_slots(row, 0, up_to)
        kv = req.kv
        held = kv.prefix_indices.shape[0]
        store = getattr(kv, "prefix_store", None)
        if store is not None and store.view is kv.prefix_indices and held <= unchanged and held <= up_to <= len(store.host):
            return store.read(row, held, up_to, row_id)
        prompt = getattr(req, "input_len", 0)
        if up_to >= prompt:  # the whole prompt at once: no later chunk to read past it
            kv.prefix_store = None
            return self._row_slots(row, 0, up_to)
        store = kv.prefix_store = PrefixStore(prompt, row_id)
        return store.read(row, 0, up_to, row_id)

    # -- eviction -----------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, lowest priority first, until `num_tokens` are freed.

        Returns the tokens freed (whole nodes: may exceed `num_tokens`; less when the rest
        is locked). Appends an `EvictionRecord` per node to `eviction_log`.
        """
        if self.disable or num_tokens <= 0:
            return 0
        now = self._begin()
        freed = 0
        while freed < num_tokens:
            node = self._queue.pop()
            if node is None:
                break
            freed += self._delete_leaf(node, now)
        self.evicted_tokens_total += freed
        return freed

    def _delete_leaf(self, node: TreeNode, now: float) -> int:
        size = len(node.key)
        if self.allocator is not None:
            if getattr(self.allocator, "ledger", None) is not None:  # TREE -> FREE in one transition
                self.allocator.free(node.value, owner=TREE, op="evict", **self._segment)
            else:
                self.allocator.free(node.value, **self._segment)
        parent = node.parent
        del parent.children[self._child_key(node.extra_key, node.key, 0)]
        self._total -= size
        self._evictable -= size
        self._num_nodes -= 1
        if self.future is None:
            self.eviction_log.append(EvictionRecord(size, now - node.birth_time, node.hit_count))
        else:
            first = self._first_handle(node)
            last_use, next_use = self.future.last_and_next_use(first)
            self.eviction_log.append(EvictionRecord(size, now - node.birth_time, node.hit_count,
                                                    -1 if last_use is None else last_use,
                                                    -1 if next_use is None else next_use))
        if self.kv_events:
            self._events.extend(BlockRemoved((h,)) for h in node.page_hashes)
        node.value, node.parent = None, None
        if parent is not self.root:
            self._touched(parent)
        return size

    # -- the trace's future (Belady) ------------------------------------------------------

    def _end_handle(self, node: TreeNode) -> Any:
        """The future's handle of the path root -> end of `node` (memoised on the nodes)."""
        chain, top = [], node
        while top is not self.root and top.future_end is _UNKNOWN:
            chain.append(top)
            top = top.parent
        for path_node in reversed(chain):
            path_node.future_end = self.future.advance(self._start_handle(path_node), path_node.key)
        return node.future_end

    def _start_handle(self, node: TreeNode) -> Any:
        parent = node.parent
        return self.future.start(node.extra_key) if parent is self.root else parent.future_end

    def _first_handle(self, node: TreeNode) -> Any:
        """The handle of `node`'s first page (memoised until the node is split): read off the
        prompt of the request whose tokens the path holds where the future indexes prompts,
        else walked along the path (`_first_handle_walked`)."""
        if node.future_first is _UNKNOWN:
            index = None if node.origin is None else self.future.prompt_index(node.origin)
            if index is None:
                node.future_first = self._first_handle_walked(node)
            else:
                node.future_first = self.future.prompt_handle(index, self._depth(node.parent) + self.page_size)
        return node.future_first

    def _first_handle_walked(self, node: TreeNode) -> Any:
        """`node`'s first-page handle by advancing the future along the path's tokens."""
        if node.parent is not self.root:
            self._end_handle(node.parent)
        return self.future.advance(self._start_handle(node), node.key[: self.page_size])

    def _depth(self, node: TreeNode) -> int:
        """Tokens on the path from the root to the end of `node`."""
        depth = 0
        while node is not self.root:
            depth += len(node.key)
            node = node.parent
        return depth

    def _belady_priority(self, node: TreeNode) -> tuple[float, float]:
        """Furthest next use first; never used again before anything; ties least recently used."""
        if self.future is None:
            raise ValueError("eviction_policy belady needs the trace's future uses (RadixCache.future), which only"
                             " a replay of a trace provides")
        next_use = self.future.next_use(self._first_handle(node))
        return (-math.inf if next_use is None else -next_use, node.last_access_time)

    # -- locks --------------------------------------------------------------------------

    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        path = []
        while node is not self.root:
            if node.parent is None:
                raise IntegrityError(
                    f"node {node.id} is not in this tree (evicted, or from another tree): cannot lock or unlock it"
                )
            path.append(node)
            node = node.parent
        return path

    def inc_lock_ref(self, node: Optional[TreeNode]) -> int:
        """Lock the path root -> `node`; return the change in evictable tokens (<= 0).

        None and the root are no-ops. Raises `IntegrityError` for a node not in this tree.
        """
        if self.disable or node is None:
            return 0
        delta = 0
        for path_node in self._path_to_root(node):
            if path_node.lock_ref == 0:
                size = len(path_node.key)
                self._evictable -= size
                self._protected += size
                delta -= size
            path_node.lock_ref += 1
        return delta

    def dec_lock_ref(self, node: Optional[TreeNode]) -> int:
        """Unlock one holder of the path root -> `node`; return the change in evictable (>= 0).

        None and the root are no-ops. Raises `IntegrityError`, changing nothing, when
        `node` is not locked (an unmatched unlock) or not in this tree.
        """
        if self.disable or node is None or node is self.root:
            return 0
        if node.lock_ref <= 0:
            raise IntegrityError(f"dec_lock_ref on node {node.id} whose lock_ref is {node.lock_ref}: unlock without lock")
        delta = 0
        for path_node in self._path_to_root(node):
            if path_node.lock_ref == 1:
                size = len(path_node.key)
                self._evictable += size
                self._protected -= size
                delta += size
            path_node.lock_ref -= 1
        self._touched(node)
        return delta

    def move_lock(self, old: Optional[TreeNode], new: TreeNode) -> None:
        """`inc_lock_ref(new)` then `dec_lock_ref(old)`: a request's lock moving to `new`.

        Where `old` is on the path to `new` (a checkpoint extends the request's path), the
        path above `old` is incremented and decremented by the two calls and ends as it was:
        only the nodes from `new` up to `old` are locked here, and `old` is re-queued as the
        decrement does. Otherwise, the two calls."""
        if self.disable or old is None or old is self.root:
            self.inc_lock_ref(new)
            self.dec_lock_ref(old)
            return
        below, node, root = [], new, self.root
        while node is not old:
            if node is root or node is None or node.parent is None:  # not a descendant: the two calls
                self.inc_lock_ref(new)
                self.dec_lock_ref(old)
                return
            below.append(node)
            node = node.parent
        for path_node in below:
            if path_node.lock_ref == 0:
                size = len(path_node.key)
                self._evictable -= size
                self._protected += size
            path_node.lock_ref += 1
        self._touched(old)

    # -- requests -----------------------------------------------------------------------

    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        """See `BasePrefixCache.cache_finished_req`. Row ranges (ps = page size):

            [0, start)                 tree slots (locked prefix), untouched
            [start, new_prefix_len)    duplicates of what the tree got meanwhile: freed
            [new_prefix_len, aligned)  inserted: the tree owns them now
            [aligned, kv_allocated_len) the request's tail (partial last page): freed
        where start = len(prefix_indices) floored to a page and aligned =
        kv_committed_len floored to a page. With is_insert=False all of
        [start, kv_allocated_len) is freed: in one call, or with `retract_free_twice` as
        [start, aligned) then [aligned, kv_allocated_len) (SGLang's order of frees).

        Request fields: reads `req_pool_idx`, `kv_allocated_len`, `kv_committed_len`,
        `prefix_indices`, `last_node`; writes only `kv_freed` (as SGLang), last.
        """
        if req.kv_freed:
            raise IntegrityError(f"cache_finished_req on request row {req.req_pool_idx} that was already freed")
        if self.unified and not self.disable:
            return self._release_unified(req, is_insert)
        ps, row, op = self.page_size, req.req_pool_idx, "cache_finished_req"
        allocated = req.kv_allocated_len
        kv = self._row_slots(self._row(req.req_pool_idx), 0, allocated)
        start = align_down(len(req.prefix_indices), ps)
        if self.disable:
            start = 0
        elif is_insert:
            aligned = max(align_down(min(req.kv_committed_len, allocated), ps), start)
            # The locked prefix [0, start) is the path to the request's locked node.
            new_prefix_len = self.insert(_request_key(req, req.token_ids(aligned)), kv[:aligned], on_path=start)
            self._check_prefix_kept(req, start, new_prefix_len)
            self._to_tree(kv[new_prefix_len:aligned], row, op)
            self._free(kv[start:new_prefix_len], row, op)
            start = aligned
        elif self.retract_free_twice:
            aligned = max(align_down(min(req.kv_committed_len, allocated), ps), start)
            self._free(kv[start:aligned], row, op)
            start = aligned
        self._free(kv[start:], row, op)
        self.req_to_token_pool.free(req.req_pool_idx)
        self.dec_lock_ref(req.last_node)
        req.kv.kv_freed = True

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        """See `BasePrefixCache.cache_unfinished_req`. After it, with n = len(fill_ids):

            row [0, aligned)  the tree's slots (request duplicates freed), locked via last_node
            row [aligned, n)  the request's own partial page (ps > 1), kept in prefix_indices

        Request fields: reads `req_pool_idx`, `fill_ids`, `extra_key`, `prefix_indices`,
        `last_node`; writes, together at the end, `prefix_indices` (the next round's prefix),
        `last_node` (the lock it now holds) and `last_matched_prefix_len` (the tree-owned
        part of the row, read by the conservation checks), as SGLang does. With the cache
        disabled only `prefix_indices`.
        """
        ps = self.page_size
        fill_len = len(req.fill_ids)
        if self.unified and not self.disable:
            self._checkpoint_unified(req, fill_len)
            return
        row = self._row(req.req_pool_idx)
        kv = self._row_slots(row, 0, fill_len)
        if self.disable:
            req.kv.prefix_indices = kv
            return
        aligned = align_down(fill_len, ps)
        start = align_down(len(req.prefix_indices), ps)
        key = _request_key(req, req.fill_ids[:aligned])
        new_prefix_len = self.insert(key, kv[:aligned], chunked=chunked, on_path=start)  # start: the locked prefix
        self._check_prefix_kept(req, start, new_prefix_len)
        op = "cache_unfinished_req"
        self._to_tree(kv[new_prefix_len:aligned], req.req_pool_idx, op)
        self._free(kv[start:new_prefix_len], req.req_pool_idx, op)
        self._begin()
        node, tree_len, _ = self._walk(key.token_ids, key.extra_key, count_hit=False, on_path=aligned)
        if tree_len != aligned:
            raise IntegrityError(f"cache_unfinished_req: re-match found {tree_len} of {aligned} tokens just inserted")
        if start < tree_len:
            self._write_row(row, start, self._path_tail(node, tree_len - start))  # the tree's [start, tree_len)
            ledger = getattr(self.allocator, "ledger", None)
            if ledger is not None:
                ledger.wrote(req.req_pool_idx, start, tree_len)
        self.move_lock(req.last_node, node)
        # The next round's prefix: the tree's slots of [0, tree_len) (the locked prefix's, which the
        # row held from its extend, and those just written) and the row's own tail: the row's
        # first `fill_len` slots now (rewritten from `start` on).
        req.kv.prefix_indices = self._next_prefix(req, row, req.req_pool_idx, start, fill_len)
        req.kv.last_node = node
        req.kv.last_matched_prefix_len = tree_len

    # -- SGLang 0.5.23's request paths (checkpoint_into_tree, release_kv_cache) -----------

    def _checkpoint_unified(self, req: Any, up_to: int, keep_prefix: bool = True) -> None:
        """0.5.23's `checkpoint_into_tree`: insert the row's first `up_to` tokens (page-aligned;
        the insert frees what duplicates the tree past the protected prefix), then, with
        `split_prompt`, the prompt again (one priority up, freeing and counting nothing) so a
        leaf that runs past the prompt splits at its page-aligned end; the row points at the
        tree's slots, and the lock moves to the node the first insert ended on.

        Only the row past the protected prefix is read: the prefix is the tree's already (the
        request holds its lock). `keep_prefix=False` (a release) leaves `prefix_indices` as it
        was, since nothing reads it once the row is freed."""
        ps, row_id = self.page_size, req.req_pool_idx
        row = self._row(row_id)
        held = req.prefix_indices.shape[0]
        protected = held - held % ps
        # Never below the prefix the request holds from the tree (a request released before
        # its first chunk committed anything keeps its matched prefix, and frees only its own slots).
        aligned = max(align_down(up_to, ps), protected)
        kv = self._row_slots(row, protected, aligned)  # the row's slots of [protected, aligned)
        key = _request_key(req, req.token_ids(aligned))
        # The locked prefix [0, protected) is the path to the request's locked node.
        _, node = self.insert_unified(key, kv, protected, req.kv.cache_inserted_len, owner=row_id,
                                      value_start=protected, owned=True, on_path=protected)
        req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, aligned)
        prompt = align_down(req.input_len, ps)
        if self.split_prompt and 0 < prompt < aligned and not self._stamp_prompt_path(node, aligned, prompt):
            first = min(protected, prompt)
            self.insert_unified(_request_key(req, req.token_ids(prompt)), kv[: prompt - first], prompt, prompt,
                                value_start=first, on_path=prompt)  # the first insert just walked it
        new_slots = self._path_tail(node, aligned - protected)  # the tree's slots of [protected, aligned)
        if protected < aligned:
            self._point_row_at_tree(row, row_id, protected, kv, new_slots)
        if keep_prefix:
            # The next round's prefix: the locked prefix, the tree's new slots and the row's own
            # tail, which is what the row holds now (it held the locked prefix from the extend
            # that wrote it, and was just pointed at the tree's slots from `protected` on).
            req.kv.prefix_indices = self._next_prefix(req, row, row_id, protected, up_to)
        self.move_lock(req.last_node, node)
        req.kv.last_node = node
        req.kv.last_matched_prefix_len = aligned

    def _stamp_prompt_path(self, node: TreeNode, end: int, prompt: int) -> bool:
        """The prompt's insert of `_checkpoint_unified` without its walk, where it would only
        stamp: `node` ends the path the first insert just walked, at `end`, and a node of that
        path ends exactly at `prompt`. The insert of the prompt then splits nothing (no node
        holds the prompt's end inside it), frees nothing (every slot is below its
        `prev_prefix_len`), counts no hit and adds no leaf; what it does is stamp the root and
        each node down to the prompt's end, in that order, and re-queue the last. That is done
        here, and True returned; False, with nothing done, where a node holds the prompt's end
        inside it or a node of the path has no device slots (a host-only node), which the
        insert itself must handle."""
        path, root = [], self.root
        while node is not root:
            start = end - len(node.key)
            if start < prompt < end or node.value is None:
                return False
            if end <= prompt:
                path.append(node)
            node, end = node.parent, start
        self._begin()
        root.last_access_time = self._stamp()
        for node in reversed(path):
            node.last_access_time = self._stamp()
        self._touched(path[0] if path else root)
        return True

    def _point_row_at_tree(self, row: "torch.Tensor | np.ndarray", row_id: int, start: int, own: torch.Tensor,
                           tree: torch.Tensor) -> None:
        """Request row `row_id`'s positions from `start` held the slots `own`, and now hold the
        tree's `tree` (where the tree had them already, the insert freed `own`'s)."""
        end = start + tree.shape[0]
        ledger = getattr(self.allocator, "ledger", None)
        # The tree kept the row's own slots (a new leaf views them): the row holds them already.
        kept = tree.data_ptr() == own.data_ptr() and tree.shape == own.shape and tree.stride() == own.stride()
        if ledger is not None:  # the row's own slots the tree kept pass to it (all of them when kept)
            if kept:
                moved = own
            elif own.is_cpu and tree.is_cpu:  # the compare and the mask in numpy: no torch dispatch
                own_host = own.numpy()
                moved = own_host[tree.numpy() == own_host]
            else:
                moved = own[tree == own]
            ledger.move(moved, row_id, TREE, "checkpoint")
        if not kept:
            self._write_row(row, start, tree)
        if ledger is not None:
            ledger.wrote(row_id, start, end)  # checked at the step's end, as every position the step wrote

    @staticmethod
    def _write_row(row: "torch.Tensor | np.ndarray", start: int, slots: torch.Tensor) -> None:
        """`row[start:start + len(slots)] = slots`, cast to the row's dtype (one numpy cast-copy on a CPU)."""
        if isinstance(row, np.ndarray):
            row[start : start + len(slots)] = slots.numpy()
        else:
            row[start : start + len(slots)] = slots.to(row.dtype)

    def _path_tail(self, node: TreeNode, length: int) -> torch.Tensor:
        """The slots of the last `length` tokens of the path from the root to `node`."""
        values = []
        while length > 0:
            value = node.value
            size = value.shape[0]
            values.append(value if size <= length else value[size - length :])
            length -= size
            node = node.parent
        if not values:
            return self.empty_indices()
        return values[0] if len(values) == 1 else torch.cat(values[::-1])

    def _release_unified(self, req: Any, checkpoint: bool) -> None:
        """0.5.23's `release_kv_cache`: with `checkpoint`, the row's committed tokens go into
        the tree first; then the row is freed past its protected prefix in one segment."""
        committed = min(req.kv_committed_len, req.kv_allocated_len)
        if checkpoint:
            self._checkpoint_unified(req, committed, keep_prefix=False)
        start = req.kv.last_matched_prefix_len
        row = self._row_slots(self._row(req.req_pool_idx), start, req.kv_allocated_len)
        self._free(row, req.req_pool_idx, "release_kv_cache")
        self.req_to_token_pool.free(req.req_pool_idx)
        self.dec_lock_ref(req.last_node)
        req.kv.kv_freed = True

    @staticmethod
    def _check_prefix_kept(req: Any, start: int, new_prefix_len: int) -> None:
        """The request's locked prefix must still be cached; otherwise its slots were freed."""
        if new_prefix_len < start:
            raise IntegrityError(
                f"request row {req.req_pool_idx}: its prefix of {start} tokens is no longer cached (only"
                f" {new_prefix_len}); it was evicted while the request did not hold a lock on it"
            )

    def _free(self, slots: torch.Tensor, row: Any, op: str) -> None:
        """Free the request row `row`'s own `slots` (the ledger, when attached, checks they are);
        with `free_order="row"` as one segment of the row (pages in row order)."""
        if slots.shape[0] > 0:
            if getattr(self.allocator, "ledger", None) is not None and row is not None:  # row -> FREE at once
                self.allocator.free(slots, owner=row, op=op, **self._segment)
            else:
                self.allocator.free(slots, **self._segment)

    def _to_tree(self, slots: torch.Tensor, row: int, op: str) -> None:
        """`slots` of request row `row` were just inserted: the tree owns their pages now."""
        ledger = getattr(self.allocator, "ledger", None)
        if ledger is not None and len(slots) > 0:
            ledger.move(slots, row, TREE, op)

    # -- inspection ---------------------------------------------------------------------

    def _iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_values_flatten(self) -> torch.Tensor:
        """Every slot the tree owns (one tensor, no particular order)."""
        return self._cat([node.value for node in self._iter_nodes()])

    def take_events(self) -> list:
        events, self._events = self._events, []
        return events

    def snapshot_events(self) -> list:
        """The whole tree as `BlockStored` events (parents first), as if replayed from empty."""
        events = []
        stack = [(child, None) for child in self.root.children.values()]
        while stack:
            node, parent_hash = stack.pop()
            hashes = chain_page_hashes(parent_hash, node.extra_key, node.key, self.page_size)
            events.extend(stored_events(parent_hash, node.extra_key, node.key, hashes, self.page_size))
            stack.extend((child, hashes[-1]) for child in node.children.values())
        return events

    def view(self) -> TreeView:
        """The tree as it is now, read-only, for a walk (`memcli.mem_cache.tree_checks`)."""
        return TreeView(self.root, list(self._iter_nodes()), self._total, self._evictable, self._protected,
                        self._num_nodes, self.page_size, self._registered_key, self._view_queues(), self.allocator,
                        self.empty_indices())

    def _registered_key(self, node: TreeNode) -> Any:
        return self._child_key(node.extra_key, node.key, 0)

    def _view_queues(self) -> tuple:
        return (("", self._queue),)

    def check_integrity(self) -> IntegrityReport:
        """Walk the whole tree and check sizes, locks, shapes, child keys and slot ownership.

        Checks: total_size, evictable_plus_protected, evictable_size, protected_size,
        node_count, lock_refs, key_value_lengths, child_keys, unique_slots,
        slots_not_free, eviction_queue, and page_layout when page_size > 1.
        """
        return IntegrityReport("radix cache", radix_checks(self.view()))
