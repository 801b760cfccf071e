"""Triton kernels of the memory path, each beside its pure-torch reference.

Every op comes as ``op_triton``, ``op_torch`` (same signature, same validation) and a
dispatcher ``op(..., backend="triton" | "torch")``. These are the kernels the product runs:
the fused allocation steps of ``alloc.py`` (``alloc_extend_write``, ``alloc_decode_write``,
``alloc_decode_step``, which the allocator and the decode graph launch) and ``store_kv``
(bench-one-batch's K/V store). There is no unfused building block: the torch reference of
``alloc_extend_write`` computes the slots and then the rows in torch, beside it in ``alloc.py``.
"""

from .alloc import (
    ExtendWrite,
    alloc_decode_step,
    alloc_decode_step_torch,
    alloc_decode_step_triton,
    alloc_decode_write,
    alloc_decode_write_torch,
    alloc_decode_write_triton,
    alloc_extend_write,
    alloc_extend_write_torch,
    alloc_extend_write_triton,
    extend_host_plan,
    alloc_extend_write_planned,
    fill_extend_args,
    fill_extend_args_ahead,
    extend_args_entries,
    extend_output,
    extend_output_entries,
    extend_views,
    EXTEND_ARGS_HEADER,
    EXTEND_ARG_CALL,
    EXTEND_ARG_OUT,
    FREE_ROWS_SORT_MAX,
    free_rows_triton,
    free_rows_planned,
    free_rows_block,
    FREE_ARGS,
    FREE_ARG_DONE,
    FREE_ARG_CALL,
    pack_free_state,
    unpack_free_state,
)
from .kv_store import store_kv, store_kv_torch, store_kv_triton

__all__ = [
    "ExtendWrite",
    "alloc_decode_step",
    "alloc_decode_step_torch",
    "alloc_decode_step_triton",
    "alloc_decode_write",
    "alloc_decode_write_torch",
    "alloc_decode_write_triton",
    "alloc_extend_write",
    "alloc_extend_write_torch",
    "alloc_extend_write_triton",
    "extend_host_plan",
    "alloc_extend_write_planned",
    "fill_extend_args",
    "fill_extend_args_ahead",
    "extend_args_entries",
    "extend_output",
    "extend_output_entries",
    "extend_views",
    "EXTEND_ARGS_HEADER",
    "EXTEND_ARG_CALL",
    "EXTEND_ARG_OUT",
    "FREE_ROWS_SORT_MAX",
    "free_rows_triton",
    "free_rows_planned",
    "free_rows_block",
    "FREE_ARGS",
    "FREE_ARG_DONE",
    "FREE_ARG_CALL",
    "pack_free_state",
    "unpack_free_state",
    "store_kv",
    "store_kv_torch",
    "store_kv_triton",
]
