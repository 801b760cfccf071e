"""SGLang 0.5.23's real memory stack on CPU: pools, allocator and `UnifiedRadixCache`.

    stack = build_stack_0523(ref, size=64, page_size=16, core="rust")
    stack.tree, stack.allocator, stack.req_to_token_pool, stack.kv_pool

`core` is the tree core (`"rust"`, SGLang's default, or `"python"`). `disable=True` builds
the tree `--disable-radix-cache` builds (no ChunkCache in 0.5.23).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

CORES = ("rust", "python")


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
                     rows: int = 8, context_len: int = 256, disable: bool = False) -> Stack0523:
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
    return Stack0523(tree, allocator, req_pool, kv_pool, core)


def tree_core_name(stack: Stack0523) -> str:
    """The class of the core the tree runs on (`RustUnifiedTreeCore` or `UnifiedTreeCore`)."""
    return type(stack.tree.tree_core).__name__
