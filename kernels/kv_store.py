"""KV store: write the K/V of new tokens into the pool at ``loc``, for every layer at once.

Buffers are ``[num_layers, rows, heads, head_dim]``; a token's row is the ``heads * head_dim``
contiguous values of one slot. One launch covers all layers: grid
``(cdiv(n, BLOCK_T), num_layers)``, each program copies a ``BLOCK_T``-token tile across the row
width in ``BLOCK_W`` steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, check_backend, check_tensor, check_triton_device, next_power_of_2

# Torch cannot index_put float8; both backends move such tensors as raw bytes.
_BYTE_VIEW_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
_MAX_BLOCK_W = 1024
_TILE_ELEMS = 4096


@triton.jit(do_not_specialize=["num_tokens", "k_new_layer_stride", "v_new_layer_stride"])
def _store_kv_kernel(
    k_buffer_ptr,
    v_buffer_ptr,
    loc_ptr,
    k_new_ptr,
    v_new_ptr,
    num_tokens: tl.int64,
    row_width,
    k_buf_layer_stride,
    k_buf_row_stride,
    v_buf_layer_stride,
    v_buf_row_stride,
    k_new_layer_stride,
    k_new_row_stride,
    v_new_layer_stride,
    v_new_row_stride,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    layer = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < num_tokens
    loc = tl.load(loc_ptr + t, mask=t_mask, other=0)[:, None]
    k_dst = k_buffer_ptr + layer * k_buf_layer_stride + loc * k_buf_row_stride
    v_dst = v_buffer_ptr + layer * v_buf_layer_stride + loc * v_buf_row_stride
    k_src = k_new_ptr + layer * k_new_layer_stride + t[:, None] * k_new_row_stride
    v_src = v_new_ptr + layer * v_new_layer_stride + t[:, None] * v_new_row_stride
    for w_start in range(0, row_width, BLOCK_W):
        w = (w_start + tl.arange(0, BLOCK_W))[None, :]
        mask = t_mask[:, None] & (w < row_width)
        tl.store(k_dst + w, tl.load(k_src + w, mask=mask), mask=mask)
        tl.store(v_dst + w, tl.load(v_src + w, mask=mask), mask=mask)


def _check_store_kv(k_buffer, v_buffer, loc, k_new, v_new):
    check_tensor("k_buffer", k_buffer, dtype=None, ndim=4)
    device, dtype = k_buffer.device, k_buffer.dtype
    if not dtype.is_floating_point:
        raise ValueError(f"k_buffer must have a float dtype, got {dtype}")
    num_layers, _, heads, head_dim = k_buffer.shape
    check_tensor("loc", loc, device=device, contiguous=True)
    n = loc.shape[0]
    expected_new = (num_layers, n, heads, head_dim)
    for name, t, shape in (
        ("v_buffer", v_buffer, tuple(k_buffer.shape)),
        ("k_new", k_new, expected_new),
        ("v_new", v_new, expected_new),
    ):
        check_tensor(name, t, dtype=dtype, ndim=4, device=device)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer), ("k_new", k_new),
                    ("v_new", v_new)):
        if t.stride(3) != 1 or t.stride(2) != head_dim:
            raise ValueError(f"{name} must be contiguous over (heads, head_dim)")


def _storage_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _BYTE_VIEW_DTYPES else t


def store_kv_triton(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> None:
    """Triton ``store_kv`` (one launch for all layers); see :func:`store_kv`."""
    _check_store_kv(k_buffer, v_buffer, loc, k_new, v_new)
    check_triton_device(k_buffer.device, _store_kv_kernel)
    num_layers, n = k_new.shape[0], k_new.shape[1]
    if n == 0 or num_layers == 0:
        return
    row_width = k_buffer.shape[2] * k_buffer.shape[3]
    block_w = min(next_power_of_2(row_width), _MAX_BLOCK_W)
    block_t = max(1, _TILE_ELEMS // block_w)
    kb, vb, kn, vn = (_storage_view(t) for t in (k_buffer, v_buffer, k_new, v_new))
    _store_kv_kernel[(cdiv(n, block_t), num_layers)](
        kb, vb, loc, kn, vn, n, row_width,
        kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1),
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        BLOCK_T=block_t, BLOCK_W=block_w,
    )


def store_kv_torch(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> None:
    """Torch reference of ``store_kv``; see :func:`store_kv`."""
    _check_store_kv(k_buffer, v_buffer, loc, k_new, v_new)
    _storage_view(k_buffer)[:, loc] = _storage_view(k_new)
    _storage_view(v_buffer)[:, loc] = _storage_view(v_new)


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    backend: str = "triton",
) -> None:
    """``k_buffer[l, loc[t]] = k_new[l, t]`` (and the same for V) for every layer ``l``.

    Buffers ``[num_layers, rows, heads, head_dim]``, any float dtype (float8 is copied as
    bytes); ``k_new``/``v_new`` ``[num_layers, n, heads, head_dim]`` of the same dtype;
    ``loc`` int64 ``[n]`` of distinct rows (duplicates leave an unspecified winner). Layer and
    row strides are free, but each row must be contiguous. Mutates the buffers; raises
    ``ValueError`` on bad input.
    """
    check_backend(backend)
    fn = store_kv_triton if backend == "triton" else store_kv_torch
    fn(k_buffer, v_buffer, loc, k_new, v_new)
