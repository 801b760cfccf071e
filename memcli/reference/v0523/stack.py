"""SGLang 0.5.23's real memory stack on CPU: pools, allocator and `UnifiedRadixCache`.

    stack = build_stack_0523(ref, size=64, page_size=16, core="rust")
    stack.tree, stack.allocator, stack.req_to_token_pool, stack.kv_pool

`core` is the tree core (`"rust"`, SGLang's default, or `"python"`). `disable=True` builds
the tree `--disable-radix-cache` builds (no ChunkCache in 0.5.23). `host=HostTier(policy,
ratio)` adds HiCache as `--enable-hierarchical-cache` does (`UnifiedRadixCache.init_hicache`:
SGLang's own host pool, `HostPoolGroup` and `HybridCacheController`, direct copies on the CPU),
with three CPU stand-ins: the host-memory budget (psutil is not a dependency), CUDA host
registration of the host buffer (nothing to pin without a GPU), and the K/V copies themselves
(`sgl_kernel`'s transfer kernels do not load on a CPU; the slots are what the tree sees).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

CORES = ("rust", "python")


class HostTier(NamedTuple):
    write_policy: str  # --hicache-write-policy
    ratio: float  # --hicache-ratio


class Stack0523(NamedTuple):
    tree: Any
    allocator: Any
    req_to_token_pool: Any
    kv_pool: Any
    core: str


def publish_server_args(ref: Any, page_size: int, **extra: Any) -> Any:
    """Make SGLang's own `ServerArgs` (torch paths on the CPU) the process's config bags."""
    args = ref.server_args.ServerArgs(model_path="dummy", page_size=page_size, attention_backend="torch_native",
                                      device="cpu", **extra)
    ref.runtime_context.get_context().set_server_args(args)
    return args


def build_stack_0523(ref: Any, size: int, page_size: int, core: str = "rust", policy: str = "lru",
                     rows: int = 8, context_len: int = 256, disable: bool = False,
                     host: Optional[HostTier] = None) -> Stack0523:
    """A `size`-token pool of pages of `page_size`, `rows` request rows, and the tree."""
    if core not in CORES:
        raise ValueError(f"tree core {core!r}: use one of {', '.join(CORES)}")
    publish_server_args(ref, page_size)
    kv_pool = ref.MHATokenToKVPool(size, page_size, torch.float32, 1, 1, 1, "cpu", enable_memory_saver=False,
                                   enable_alt_stream=False)
    if page_size == 1:
        allocator = ref.TokenToKVPoolAllocator(size, torch.int64, "cpu", kv_pool, False)
    else:
        allocator = ref.PagedTokenToKVPoolAllocator(size, page_size, torch.int64, "cpu", kv_pool, False)
    req_pool = ref.ReqToTokenPool(size=rows, max_context_len=context_len, device="cpu", enable_memory_saver=False)
    full = ref.unified_radix_cache.ComponentType.FULL
    params = ref.CacheInitParams(disable=disable, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
                                 page_size=page_size, tree_components=(full,), eviction_policy=policy,
                                 tree_core_backend=core)
    tree = ref.UnifiedRadixCache(params)
    if host is not None:
        _init_hicache(ref, tree, params, host)
    return Stack0523(tree, allocator, req_pool, kv_pool, core)


def _init_hicache(ref: Any, tree: Any, params: Any, host: HostTier) -> None:
    """`registry.py`'s `cache.init_hicache(server_args, params)` under the HiCache arguments."""
    import sys

    base = sys.modules["sglang.srt.mem_cache.pool_host.base"]
    common = sys.modules["sglang.srt.mem_cache.pool_host.common"]
    base.host_memory_budget_bytes = lambda requested, *args, **kwargs: max(requested, 1)
    common._cuda_host_register = lambda *args, **kwargs: None
    mha = sys.modules["sglang.srt.mem_cache.pool_host.mha"].MHATokenToKVPoolHost
    mha.backup_from_device_all_layer = lambda *args, **kwargs: None
    mha.load_to_device_per_layer = lambda *args, **kwargs: None
    context = ref.runtime_context.get_context()
    context.override("memcli.reference.hicache", enable_hierarchical_cache=True, hicache_ratio=host.ratio,
                     hicache_size=0, hicache_write_policy=host.write_policy, hicache_io_backend="direct",
                     hicache_mem_layout="layer_first")
    tree.init_hicache(context.server_args, params)


def tree_core_name(stack: Stack0523) -> str:
    """The class of the core the tree runs on (`RustUnifiedTreeCore` or `UnifiedTreeCore`)."""
    return type(stack.tree.tree_core).__name__
