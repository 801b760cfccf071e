"""``req_to_token`` row writes for an extend batch, and ``get_last_loc``.

Row ``rp_i`` of ``req_to_token`` (int32 ``[rows, cols]``) after ``write_cache_indices``::

    [0, pre_i)        prefix slots   = prefix_flat[poff_i : poff_i + pre_i]
    [pre_i, seq_i)    new slots      = out_cache_loc[off_i : off_i + seq_i - pre_i]
    [seq_i, cols)     untouched

``poff`` and ``off`` are exclusive prefix sums of ``prefix_lens`` and of ``seq_lens -
prefix_lens`` in batch order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_backend, check_tensor, check_triton_device, exclusive_cumsum

_WRITE_BLOCK = 512
_LAST_LOC_BLOCK = 256


# ----------------------------------------------------------------------------- write_cache_indices


@triton.jit
def _copy_to_row(row_ptr, src_ptr, n, BLOCK: tl.constexpr):
    """``row[0:n] = src[0:n]`` narrowed to int32, in BLOCK-wide masked steps."""
    for start in range(0, n, BLOCK):
        k = start + tl.arange(0, BLOCK)
        mask = k < n
        values = tl.load(src_ptr + k, mask=mask)
        tl.store(row_ptr + k, values.to(tl.int32), mask=mask)


@triton.jit(
    do_not_specialize=["bs", "row_stride"],
    do_not_specialize_on_alignment=[
        "req_to_token_ptr", "running_sums_ptr", "out_cache_loc_ptr", "prefix_flat_ptr"
    ],
)
def _write_cache_indices_kernel(
    req_to_token_ptr,
    req_pool_indices_ptr,
    prefix_lens_ptr,
    seq_lens_ptr,
    running_sums_ptr,
    out_cache_loc_ptr,
    prefix_flat_ptr,
    bs: tl.int64,
    row_stride: tl.int64,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row_ptr = req_to_token_ptr + tl.load(req_pool_indices_ptr + pid) * row_stride
    pre = tl.load(prefix_lens_ptr + pid)
    seq = tl.load(seq_lens_ptr + pid)
    # Inclusive running sums of pre and seq -> exclusive offsets into prefix_flat / out_cache_loc.
    prefix_start = tl.load(running_sums_ptr + pid) - pre
    out_start = tl.load(running_sums_ptr + bs + pid) - seq - prefix_start
    _copy_to_row(row_ptr, prefix_flat_ptr + prefix_start, pre, BLOCK)
    _copy_to_row(row_ptr + pre, out_cache_loc_ptr + out_start, seq - pre, BLOCK)


def _check_write_cache_indices(
    req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_flat
):
    _check_req_to_token(req_to_token)
    device = req_to_token.device
    check_tensor("req_pool_indices", req_pool_indices, device=device, contiguous=True)
    bs = req_pool_indices.shape[0]
    check_tensor("prefix_lens", prefix_lens, device=device, length=bs, contiguous=True)
    check_tensor("seq_lens", seq_lens, device=device, length=bs, contiguous=True)
    check_tensor("out_cache_loc", out_cache_loc, device=device, contiguous=True)
    # An int32 prefix would be misread through an int64 pointer: reject it outright.
    check_tensor("prefix_flat", prefix_flat, device=device, contiguous=True)


def _check_req_to_token(req_to_token):
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, ndim=2)
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token rows must be contiguous (stride(1) == 1)")


def write_cache_indices_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    prefix_flat: torch.Tensor,
) -> None:
    """Triton ``write_cache_indices``; see :func:`write_cache_indices`."""
    _check_write_cache_indices(
        req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_flat
    )
    check_triton_device(req_to_token.device, _write_cache_indices_kernel)
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    # One cumsum for both offsets: off_i = sum(seq_j - pre_j, j < i) = seq sum - pre sum.
    running_sums = torch.cumsum(torch.stack((prefix_lens, seq_lens)), dim=1)
    _write_cache_indices_kernel[(bs,)](
        req_to_token, req_pool_indices, prefix_lens, seq_lens, running_sums,
        out_cache_loc, prefix_flat, bs, req_to_token.stride(0),
        BLOCK=_WRITE_BLOCK,
    )


def write_cache_indices_torch(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    prefix_flat: torch.Tensor,
    validate: bool = True,
) -> None:
    """Torch reference of ``write_cache_indices``; see :func:`write_cache_indices`.
    ``validate=False``: the caller built the inputs itself (``alloc_extend_write``)."""
    if validate:
        _check_write_cache_indices(
            req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_flat
        )
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    if req_to_token.device.type == "cpu":
        _write_rows_cpu(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_flat)
        return
    # One (row, column, value) triple per written cell; the sizes are the flat tensors'
    # lengths, so no host sync is needed to build them.
    rows_pre, cols_pre = _cells(req_pool_indices, torch.zeros_like(prefix_lens), prefix_lens,
                                prefix_flat.shape[0])
    rows_new, cols_new = _cells(req_pool_indices, prefix_lens, seq_lens, out_cache_loc.shape[0])
    req_to_token[rows_pre, cols_pre] = prefix_flat.to(torch.int32)
    req_to_token[rows_new, cols_new] = out_cache_loc.to(torch.int32)


def _write_rows_cpu(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_flat):
    """The same writes as two slice copies per request: on a CPU reading the lengths costs
    nothing, and slices beat building an index per cell."""
    pre_off = new_off = 0
    for row, pre, seq in zip(req_pool_indices.tolist(), prefix_lens.tolist(), seq_lens.tolist()):
        dest = req_to_token[row]
        if pre:  # an empty slice copy still costs a dispatch
            dest[:pre] = prefix_flat[pre_off : pre_off + pre]
        dest[pre:seq] = out_cache_loc[new_off : new_off + seq - pre]
        pre_off += pre
        new_off += seq - pre


def _cells(req_pool_indices, begin, end, total):
    """Row and column of every cell in ``[begin_i, end_i)`` of row ``req_pool_indices[i]``."""
    lens = end - begin
    req = torch.repeat_interleave(
        torch.arange(lens.shape[0], device=lens.device), lens, output_size=total
    )
    within = torch.arange(total, device=lens.device) - exclusive_cumsum(lens)[req]
    return req_pool_indices[req], begin[req] + within


def write_cache_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    prefix_flat: torch.Tensor,
    backend: str = "triton",
) -> None:
    """Write each request's prefix slots and new slots into its ``req_to_token`` row.

    Mutates ``req_to_token`` (int32, rows contiguous) in columns ``[0, seq_i)`` of each row
    ``req_pool_indices[i]`` (layout in the module docstring). ``prefix_flat`` is the int64
    concatenation of every request's prefix slots in batch order (may be empty);
    ``out_cache_loc`` holds the new slots in batch order. All int64 index tensors, contiguous,
    on ``req_to_token``'s device. The caller guarantees ``seq_i <= cols``,
    ``len(prefix_flat) == sum(prefix_lens)`` and ``len(out_cache_loc) == sum(seq_lens -
    prefix_lens)`` (not checked: that would need a host sync).
    Raises ``ValueError`` on bad input, including an int32 ``prefix_flat``.
    """
    check_backend(backend)
    fn = write_cache_indices_triton if backend == "triton" else write_cache_indices_torch
    fn(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_flat)


# ----------------------------------------------------------------------------- get_last_loc


@triton.jit(do_not_specialize=["bs", "row_stride"])
def _get_last_loc_kernel(
    req_to_token_ptr,
    req_pool_indices_ptr,
    prefix_lens_ptr,
    out_ptr,
    bs: tl.int64,
    row_stride: tl.int64,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < bs
    rp = tl.load(req_pool_indices_ptr + i, mask=mask, other=0)
    pre = tl.load(prefix_lens_ptr + i, mask=mask, other=0)
    last = tl.load(req_to_token_ptr + rp * row_stride + pre - 1, mask=mask & (pre > 0), other=-1)
    tl.store(out_ptr + i, last.to(tl.int64), mask=mask)


def _check_get_last_loc(req_to_token, req_pool_indices, prefix_lens):
    _check_req_to_token(req_to_token)
    device = req_to_token.device
    check_tensor("req_pool_indices", req_pool_indices, device=device, contiguous=True)
    bs = req_pool_indices.shape[0]
    check_tensor("prefix_lens", prefix_lens, device=device, length=bs, contiguous=True)


def get_last_loc_triton(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor
) -> torch.Tensor:
    """Triton ``get_last_loc``; see :func:`get_last_loc`."""
    _check_get_last_loc(req_to_token, req_pool_indices, prefix_lens)
    check_triton_device(req_to_token.device, _get_last_loc_kernel)
    bs = req_pool_indices.shape[0]
    out = torch.empty(bs, dtype=torch.int64, device=req_to_token.device)
    if bs == 0:
        return out
    _get_last_loc_kernel[(triton.cdiv(bs, _LAST_LOC_BLOCK),)](
        req_to_token, req_pool_indices, prefix_lens, out, bs, req_to_token.stride(0),
        BLOCK=_LAST_LOC_BLOCK,
    )
    return out


def get_last_loc_torch(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor
) -> torch.Tensor:
    """Torch reference of ``get_last_loc``; see :func:`get_last_loc`."""
    _check_get_last_loc(req_to_token, req_pool_indices, prefix_lens)
    last = req_to_token[req_pool_indices, (prefix_lens - 1).clamp(min=0)].to(torch.int64)
    return torch.where(prefix_lens > 0, last, -1)


def get_last_loc(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    backend: str = "triton",
) -> torch.Tensor:
    """Slot of each request's last prefix token: ``req_to_token[rp, pre - 1]``, -1 if ``pre == 0``.

    Returns int64 ``[bs]``; does not modify anything. Raises ``ValueError`` on bad input.
    """
    check_backend(backend)
    fn = get_last_loc_triton if backend == "triton" else get_last_loc_torch
    return fn(req_to_token, req_pool_indices, prefix_lens)
