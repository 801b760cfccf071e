"""Triton kernels of the memory path, each beside its pure-torch reference.

Every op comes as ``op_triton``, ``op_torch`` (same signature, same validation) and a
dispatcher ``op(..., backend="triton" | "torch")``.
"""

from .alloc import (
    ExtendWrite,
    alloc_decode_step,
    alloc_decode_step_torch,
    alloc_decode_step_triton,
    alloc_decode,
    alloc_decode_torch,
    alloc_decode_triton,
    alloc_decode_write,
    alloc_decode_write_torch,
    alloc_decode_write_triton,
    alloc_extend,
    alloc_extend_torch,
    alloc_extend_triton,
    alloc_extend_write,
    alloc_extend_write_torch,
    alloc_extend_write_triton,
    pack_free_state,
    unpack_free_state,
)
from .cache_indices import (
    get_last_loc,
    get_last_loc_torch,
    get_last_loc_triton,
    write_cache_indices,
    write_cache_indices_torch,
    write_cache_indices_triton,
)
from .kv_store import store_kv, store_kv_torch, store_kv_triton

__all__ = [
    "ExtendWrite",
    "alloc_decode_step",
    "alloc_decode_step_torch",
    "alloc_decode_step_triton",
    "alloc_decode",
    "alloc_decode_torch",
    "alloc_decode_triton",
    "alloc_decode_write",
    "alloc_decode_write_torch",
    "alloc_decode_write_triton",
    "alloc_extend",
    "alloc_extend_torch",
    "alloc_extend_triton",
    "alloc_extend_write",
    "alloc_extend_write_torch",
    "alloc_extend_write_triton",
    "get_last_loc",
    "pack_free_state",
    "unpack_free_state",
    "get_last_loc_torch",
    "get_last_loc_triton",
    "store_kv",
    "store_kv_torch",
    "store_kv_triton",
    "write_cache_indices",
    "write_cache_indices_torch",
    "write_cache_indices_triton",
]
