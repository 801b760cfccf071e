"""The one builder that turns a config into a memory stack.

Every component receives `memory.page_size` from the config. The only way to give a component
another page size is `page_size_overrides`, a debugging switch used by `check-page-size
--inject` to show what a mismatch breaks; normal commands never pass it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from memcli.config import Config, SemanticsConfig, host_pool_size, replace
from memcli.devices import resolve_backend, resolve_device
from memcli.errors import ConfigError
from memcli.footprint import check_footprint
from memcli.mem_cache.allocator import BaseAllocator, make_allocator
from memcli.mem_cache.base_prefix_cache import BasePrefixCache, EvictRule
from memcli.mem_cache.cache_controller import CacheController
from memcli.mem_cache.chunk_cache import ChunkCache
from memcli.mem_cache.decode_graph import DecodeGraphs
from memcli.mem_cache.extend_graph import ExtendGraphs
from memcli.mem_cache.free_graph import FreeRowsGraphs
from memcli.mem_cache.hiradix_cache import HiRadixCache
from memcli.mem_cache.host_pool import HostKVPool
from memcli.mem_cache.manager import COMPONENTS, MemoryManager
from memcli.mem_cache.null_cache import NullCache
from memcli.mem_cache.pages import align_down
from memcli.mem_cache.pools import KVPool, ReqToTokenPool
from memcli.mem_cache.radix_cache import RadixCache



@dataclass
class MemoryStack:
    """Pools, allocator and prefix cache built from one config."""

    config: Config
    device: torch.device
    backend: str
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    allocator: BaseAllocator
    tree_cache: BasePrefixCache
    scheduler_page_size: int
    null_cache: NullCache
    injected: dict[str, int] = field(default_factory=dict)
    host_pool: HostKVPool | None = None  # the hiradix host tier (None for other caches)
    memory: MemoryManager = field(init=False, repr=False)  # the one way the scheduler and tools reach it

    def __post_init__(self) -> None:
        self.memory = MemoryManager(self)

    @property
    def size(self) -> int:
        return self.allocator.size

    @property
    def page_size(self) -> int:
        return self.config.page_size

    def page_sizes(self) -> dict[str, int]:
        """The page size every component holds or reads (the host pool's only when there is one)."""
        sizes = {
            "config": self.config.page_size,
            "kv_pool": self.kv_pool.page_size,
            "allocator": self.allocator.page_size,
            "tree_cache": self.tree_cache.page_size,
            "scheduler": self.scheduler_page_size,
            "null_cache": self.null_cache.page_size,
        }
        if self.host_pool is not None:
            sizes["host_pool"] = self.host_pool.page_size
        return sizes

    def reset(self) -> None:
        """Everything free again (only valid when no request runs)."""
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()


def use_decode_graph(config: Config, device: torch.device, backend: str) -> bool:
    """Whether decode steps replay a CUDA graph (`runtime.decode_graph`); not in debug mode,
    whose per-call validation reads host values."""
    want = config.runtime.decode_graph
    possible = device.type == "cuda" and backend == "triton"
    if want is True and not possible:
        raise ConfigError("runtime.decode_graph: true needs a CUDA device and the triton kernel backend",
                          hint="use --set runtime.decode_graph=auto (or false)")
    return want is not False and possible and not config.memory.debug


def build_stack(config: Config, cache_kind: str | None = None,
                page_size_overrides: dict[str, int] | None = None, future: Any = None) -> MemoryStack:
    """Build pools, allocator and prefix cache. `cache_kind` overrides `cache.kind`.
    `future` (`memcli.workload.future.FutureUses`) is the trace's future, for the radix cache:
    `cache.eviction_policy: belady` needs it (a `ConfigError` without it).

    Raises `CapacityError` before allocating anything when the stack would not fit on the
    device (`memcli.footprint.check_footprint`)."""
    kind = cache_kind or config.cache.kind
    if kind == "radix" and config.cache.eviction_policy == "belady" and future is None:
        raise ConfigError("cache.eviction_policy: belady evicts by the trace's future uses, which only memcli replay"
                          " knows", hint="use lru, lfu or fifo here (memcli replay accepts belady)")
    overrides = dict(page_size_overrides or {})
    unknown = set(overrides) - set(COMPONENTS)
    if unknown:
        raise ConfigError(f"cannot inject a page size into {', '.join(sorted(unknown))}",
                          hint=f"components: {', '.join(COMPONENTS)}")
    ps = config.page_size
    device = resolve_device(config)
    backend = resolve_backend(config, device)
    check_footprint(config if cache_kind is None else replace(config, cache={"kind": cache_kind}), device)
    mem, model = config.memory, config.model
    size = config.pool_size
    req_to_token_pool = ReqToTokenPool(mem.max_running_requests, config.req_to_token_cols, device,
                                       config.behaviour.row_order)
    kv_pool = KVPool(size, overrides.get("kv_pool", ps), model.num_layers, model.num_kv_heads, model.head_dim,
                     model.dtype, device, materialized=mem.kv_pool == "materialized")
    alloc_ps = overrides.get("allocator", ps)
    allocator = make_allocator(size // alloc_ps * alloc_ps, alloc_ps, device, backend, mem.need_sort, mem.debug)
    if use_decode_graph(config, device, backend):
        allocator.decode_graphs = DecodeGraphs(allocator._buf, req_to_token_pool.req_to_token, alloc_ps,
                                               ring=alloc_ps == 1)
        allocator.free_graphs = FreeRowsGraphs(allocator._buf, req_to_token_pool.req_to_token, alloc_ps)
        allocator.extend_graphs = ExtendGraphs(allocator._buf, req_to_token_pool.req_to_token, alloc_ps)
    if kind == "none" and "tree_cache" in overrides:
        raise ConfigError("cannot inject tree_cache.page_size: the tree cache is the bench null cache here",
                          hint="inject null_cache.page_size instead, or use cache.kind radix or chunk")
    if "host_pool" in overrides and kind != "hiradix":
        raise ConfigError("cannot inject host_pool.page_size: only cache.kind hiradix has a host pool",
                          hint="add --set cache.kind=hiradix")
    tree_ps = overrides.get("null_cache" if kind == "none" else "tree_cache", ps)
    host_pool = None
    if kind == "hiradix":
        host_pool = make_host_pool(config, device, overrides.get("host_pool", ps))
    tree_cache = make_tree_cache(kind, config, req_to_token_pool, allocator, tree_ps, host_pool, kv_pool)
    tree_cache.evict_rule = evict_rule(config.behaviour)
    if kind == "radix":
        tree_cache.future = future
    # The bench null cache is built here too, so its page size is read from a real object.
    null_cache = tree_cache if kind == "none" else NullCache(allocator, req_to_token_pool,
                                                              overrides.get("null_cache", ps))
    return MemoryStack(config, device, backend, req_to_token_pool, kv_pool, allocator, tree_cache,
                       overrides.get("scheduler", ps), null_cache, overrides, host_pool)


def eviction_order(config: Config) -> str:
    """The eviction policy whose order the tree of `config` follows: its own, but for `lfu` on
    a radix cache that never counts hits (`lfu_hits: never`, SGLang 0.5.5's), where every
    count stays 0 and LFU's tie-break, recency, is the whole order: `lru`, step for step."""
    policy = config.cache.eviction_policy
    if policy == "lfu" and config.cache.kind == "radix" and config.behaviour.lfu_hits == "never":
        return "lru"
    return policy


def evict_rule(behaviour: SemanticsConfig) -> EvictRule:
    """How the allocation entry points ask the tree for room, for the behaviours in force."""
    return EvictRule(full_need=behaviour.evict_amount == "full_need",
                     page_per_request=behaviour.page_estimate == "one_per_request")


# The radix cache's options for 0.5.23's unified tree (`radix_semantics`), which the host tier does not take.
UNIFIED_TREE_OPTIONS = ("tree_stamps", "insert_hits", "free_order", "prompt_split")


def radix_semantics(behaviour: SemanticsConfig) -> dict[str, Any]:
    """The radix cache's constructor options for the behaviours in force."""
    return {"lru_clock": behaviour.lru_clock, "split_stamp": behaviour.split_stamp,
            "count_hits": behaviour.lfu_hits == "count", "retract_free": behaviour.retract_free,
            "tree_stamps": behaviour.tree_stamps, "insert_hits": behaviour.lfu_hits == "insert",
            "free_order": behaviour.free_order, "prompt_split": behaviour.prompt_split}


def make_host_pool(config: Config, device: torch.device, page_size: int) -> HostKVPool:
    """The hiradix host pool: indices only, or K/V in pinned host memory when the device pool
    is materialized on a GPU. `page_size` differs from the config's only under injection."""
    model = config.model
    size = align_down(host_pool_size(config), page_size)
    materialized = config.memory.kv_pool == "materialized" and device.type == "cuda"
    return HostKVPool(size, page_size, model.num_layers, model.num_kv_heads, model.head_dim, model.dtype,
                      materialized=materialized, pin_memory=materialized)


def make_tree_cache(kind: str, config: Config, req_to_token_pool: ReqToTokenPool, allocator: BaseAllocator,
                    page_size: int, host_pool: HostKVPool | None = None, kv_pool: KVPool | None = None) -> BasePrefixCache:
    if kind == "hiradix":
        return make_hiradix_cache(config, req_to_token_pool, allocator, page_size, host_pool, kv_pool)
    if kind == "radix":
        return RadixCache(req_to_token_pool, allocator, page_size, eviction_policy=config.cache.eviction_policy,
                          kv_events=config.cache.kv_events, **radix_semantics(config.behaviour))
    if kind == "chunk":
        return ChunkCache(req_to_token_pool, allocator, page_size,
                          count_protected=config.behaviour.chunk_cache_protected == "counted")
    if kind == "none":
        return NullCache(allocator, req_to_token_pool, page_size)
    raise ConfigError(f"cache.kind: invalid value {kind!r}", hint="cache.kind must be one of radix, hiradix, chunk, none")


def make_hiradix_cache(config: Config, req_to_token_pool: ReqToTokenPool, allocator: BaseAllocator, page_size: int,
                       host_pool: HostKVPool, kv_pool: KVPool | None = None) -> HiRadixCache:
    """The hierarchical cache with its controller, timed by `config.sim`'s host transfer costs.

    A host pool whose page size differs from the tree's (`--inject host_pool.page_size`) is
    built anyway; the cache then refuses it, which `check-page-size` reports."""
    cache = config.cache
    behaviour = config.behaviour
    controller = CacheController(allocator, host_pool, cache.write_policy, config.model.bytes_per_token,
                                 config.sim.host_bandwidth_gbps, config.sim.host_latency_us, kv_pool=kv_pool)
    semantics = radix_semantics(behaviour)
    semantics.pop("count_hits")
    if behaviour.tree_stamps != "unified":  # 0.5.5's tree: its own insert walk
        for key in UNIFIED_TREE_OPTIONS:
            semantics.pop(key)
    return HiRadixCache(req_to_token_pool, allocator, page_size, host_pool, write_policy=cache.write_policy,
                        load_back_threshold=cache.load_back_threshold, controller=controller,
                        host_floor=behaviour.host_pool_floor, eviction_policy=cache.eviction_policy,
                        shortfall_first=behaviour.hicache_evict == "shortfall",
                        demote_per_node=behaviour.write_back_demote == "per_node",
                        reclaim_duplicates=behaviour.write_back_host_reclaim == "duplicates_first", **semantics)
