"""The prefix-cache interface shared by `RadixCache`, `ChunkCache` and `NullCache`.

A prefix cache sits in front of the KV allocator. It never allocates: it takes ownership of
slots that requests computed (`insert`, `cache_*_req`) and gives them back to the allocator
(`evict`, duplicates freed in `cache_*_req`). Sizes are in tokens.

Ownership of one request row of `req_to_token` (ps = page size):

    [0, last_matched_prefix_len)          slots owned by the tree (locked through last_node)
    [last_matched_prefix_len, kv_allocated_len)   slots owned by the request
                                         (a partial page after cache_unfinished_req,
                                          then everything allocated for extend / decode)
"""

from __future__ import annotations

import abc
from typing import Any, Iterator, NamedTuple, Optional

import numpy as np
import torch

from memcli.check_result import IntegrityReport


class MatchResult(NamedTuple):
    """What `match_prefix` found.

    `device_indices`: int64 1-D tensor of KV slots of the matched prefix (page-aligned
    length). `last_node`: the node to lock for that prefix (the root when nothing matched;
    None for caches without a tree). A hierarchical cache also reports the match's part
    that only the host holds: `host_hit_length` tokens after the device prefix, ending at
    `last_host_node` (the deepest matched node with a host copy); 0 and None elsewhere.
    """

    device_indices: torch.Tensor
    last_node: Any
    last_host_node: Any = None
    host_hit_length: int = 0


def as_token_array(token_ids: Any) -> np.ndarray:
    """Token ids as a 1-D int64 numpy array (no copy when already one)."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    array = np.asarray(token_ids, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {array.shape}")
    return array


class RadixKey:
    """Token ids plus an optional namespace (`extra_key`: LoRA id, cache salt, ...).

    Keys with different `extra_key` never share cached tokens. Slicing returns a RadixKey
    with the same `extra_key` that views the same array (no copy). `origin` (optional): the
    id of the request whose token ids these are (a prefix of its prompt and outputs), which
    the cache may keep on the nodes it creates; it never changes what is matched.
    """

    __slots__ = ("token_ids", "extra_key", "origin")

    def __init__(self, token_ids: Any, extra_key: Optional[str] = None, origin: Optional[str] = None):
        self.token_ids: np.ndarray = as_token_array(token_ids)
        self.extra_key = extra_key
        self.origin = origin

    def __len__(self) -> int:
        return len(self.token_ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self.token_ids.tolist())

    def __getitem__(self, index: int | slice) -> "RadixKey":
        if isinstance(index, slice):
            return RadixKey(self.token_ids[index], self.extra_key, self.origin)
        n = len(self.token_ids)
        if not -n <= index < n:
            raise IndexError(f"RadixKey index {index} out of range for length {n}")
        index %= n
        return RadixKey(self.token_ids[index : index + 1], self.extra_key, self.origin)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RadixKey):
            return NotImplemented
        return self.extra_key == other.extra_key and np.array_equal(self.token_ids, other.token_ids)

    __hash__ = None  # mutable array inside

    def __repr__(self) -> str:
        head = self.token_ids[:10].tolist()
        more = "..." if len(self.token_ids) > 10 else ""
        return f"RadixKey(extra_key={self.extra_key!r}, token_ids={head}{more})"


class EvictRule(NamedTuple):
    """How the memory manager's allocation verbs (`mem_cache.manager`) ask a cache for room.

    `full_need`: when the free list is short of a need, evict the whole need (SGLang 0.5.5's
    `evict_from_tree_cache`) instead of the shortfall. `page_per_request`: before a paged
    allocation, assume each request opens one new page (SGLang's over-estimate: extend needs
    `extend_num_tokens + bs * page_size`, decode `bs * page_size`) instead of the exact count.
    """

    full_need: bool = False
    page_per_request: bool = False


class BasePrefixCache(abc.ABC):
    """Interface of every prefix cache. Subclasses set the attributes in `__init__`.

    Attributes: `req_to_token_pool`, `allocator` (the KV slot allocator, also reachable as
    `token_to_kv_pool_allocator`), `page_size` (given by the stack builder, never a
    default), `device`, `disable` (True when the cache shares nothing between requests),
    `evict_rule` (set by the stack builder from the semantics in force).
    """

    req_to_token_pool: Any
    allocator: Any
    page_size: int
    device: torch.device
    disable: bool
    evict_rule: EvictRule = EvictRule()

    @property
    def token_to_kv_pool_allocator(self) -> Any:
        return self.allocator

    def tree_protected_size(self) -> int:
        """Locked tokens the cache itself owns (the conservation checks count these); equal to
        `protected_size()` except where a cache reports request-held tokens as protected."""
        return self.protected_size()

    def empty_indices(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)

    # -- lookup and storage -------------------------------------------------------------

    @abc.abstractmethod
    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached prefix of `key`, floored to whole pages.

        Does not take a lock (call `inc_lock_ref(result.last_node)`). May refresh access
        statistics and split one node; never changes which slots are cached.
        """

    def touch_prefix(self, key: RadixKey) -> None:
        """Walk `key` as `match_prefix` does (its stamps, splits and counts), adopting nothing:
        SGLang 0.5.23's waiting-prefix refresh. A cache whose match builds what the walk
        does not need overrides it."""
        self.match_prefix(key)

    @abc.abstractmethod
    def insert(self, key: RadixKey, value: Optional[torch.Tensor] = None) -> int:
        """Cache `value[i]` as the slot of `key[i]`; return the leading tokens already cached.

        Only the page-aligned part of `key` is stored. Slots `value[:returned]` duplicate
        cached ones: the caller still owns them and must free them. The cache takes
        ownership of `value[returned:aligned_len]`.
        """

    @abc.abstractmethod
    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        """Release everything `req` holds, exactly once, and unlock its prefix.

        With `is_insert` its committed page-aligned tokens go into the cache first (their
        duplicates are freed); with `is_insert=False` (retraction) the request's own slots
        are all freed. Frees the request row and sets `req.kv_freed`; raises
        `IntegrityError` when it was already set.
        """

    @abc.abstractmethod
    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        """After a prefill round: cache `req.fill_ids` so far and move the request's lock.

        Sets `req.prefix_indices` to slots covering all of `fill_ids` (tree slots, then the
        request's own partial page) and rewrites the request row to use the tree's slots.
        """

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked cached tokens when possible; return tokens freed.

        Node-granular: may free more than asked, or less when the rest is locked. Evicting
        0 is always safe.
        """

    @abc.abstractmethod
    def inc_lock_ref(self, node: Any) -> int:
        """Protect the path root -> `node` from eviction; return the change in evictable tokens."""

    @abc.abstractmethod
    def dec_lock_ref(self, node: Any) -> int:
        """Undo one `inc_lock_ref(node)`; return the change in evictable tokens.

        Raises `IntegrityError` for an unmatched unlock (lock counts never go negative).
        """

    # -- host tier (HiRadixCache); no-ops for caches without one --------------------------

    def init_load_back(self, last_host_node: Any, host_hit_length: int,
                       mem_quota: Optional[int] = None) -> tuple[torch.Tensor, Any]:
        """Bring a match's host-only part back to the device; returns (new device slots, the
        new last device node). Only called when a match reported `host_hit_length > 0`."""
        raise NotImplementedError(f"{type(self).__name__} has no host tier")

    def check_hicache_events(self) -> None:
        """Acknowledge host copies that are done (their nodes are unlocked)."""

    def host_tier(self) -> Optional[Any]:
        """The host tier's counters (`HostTierCounters`), or None for a cache without one."""
        return None

    def copy_protected_size(self) -> int:
        """Device tokens locked only because a host copy of theirs is in flight (at idle the
        only locks left); 0 for caches without a host tier."""
        return 0

    def next_copy_end(self) -> Optional[float]:
        """When the oldest host copy in flight ends, on the cache's clock (None: none in flight)."""
        return None

    def finish_copies(self) -> None:
        """Wait for every copy in flight and acknowledge it (end of a replay)."""

    def pending_transfer_stall_ms(self) -> float:
        """What `take_transfer_stall_ms` would hand over now (0 without a host tier)."""
        return 0.0

    def take_transfer_stall_ms(self) -> float:
        """Time the caller must wait for copies it depends on (write-backs during eviction),
        accumulated since the last call; 0 for caches without a host tier."""
        return 0.0

    def ready_to_load_host_cache(self) -> Optional[float]:
        """Start the load-backs queued for the batch being built; the time (on the cache's
        clock) they end, or None when none is queued."""
        return None

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget every cached token. Does not return slots to the allocator."""

    # -- sizes (tokens) -----------------------------------------------------------------

    def evictable_size(self) -> int:
        """Cached tokens that no request locks."""
        return 0

    def protected_size(self) -> int:
        """Cached (or held) tokens that some request locks."""
        return 0

    def total_size(self) -> int:
        """Cached tokens: `evictable_size() + protected_size()` for a tree."""
        return 0

    # -- inspection ---------------------------------------------------------------------

    @abc.abstractmethod
    def check_integrity(self) -> IntegrityReport:
        """Walk the cache and report every invariant with its numbers. Does not mutate."""

    def take_events(self) -> list:
        """KV events queued since the last call (oldest first); clears the queue."""
        return []
