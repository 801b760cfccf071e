"""Page arithmetic: the one home of token <-> page conversions.

A page is `page_size` consecutive slots; position `t` of a request row sits at offset
`t % page_size` of its page. Every function takes ints, numpy arrays or integer tensors
unless its signature says otherwise, and none touches the device.

Length convention for decode: `seq_lens` are the lengths *before* the step (the new token is
written at column `seq_len`), the convention of `alloc_for_decode` and of the fused decode
kernel. A request opens a page when its new position starts one: `seq_len % page_size == 0`.

(`kernels/` keeps its own `cdiv`: kernels import nothing from memcli.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only: config.py and workload/ use these helpers without torch
    import torch


def cdiv(a, b):
    """Ceiling division (non-negative numerators): `cdiv(tokens, page_size)` is a page count."""
    return -(-a // b)


def page_ids(slots: np.ndarray, page_size: int) -> np.ndarray:
    """The page of each slot, `slots // page_size` (page size 1: `slots` itself): for a
    power-of-two page an arithmetic shift, which is that floor division for every integer
    (negative and out-of-pool slots included), without a division per slot."""
    if page_size == 1:
        return slots
    if page_size & (page_size - 1):
        return slots // page_size
    return slots >> (page_size.bit_length() - 1)


def num_pages(num_tokens, page_size: int):
    """Pages that hold `num_tokens` tokens (a partial last page counts as one)."""
    return cdiv(num_tokens, page_size)


def whole_pages(num_tokens, page_size: int):
    """Whole pages within `num_tokens` tokens (a partial last page does not count)."""
    return num_tokens // page_size


def align_down(num_tokens, page_size: int):
    """`num_tokens` floored to whole pages (the page-aligned part of a length)."""
    return num_tokens // page_size * page_size


def align_up(num_tokens, page_size: int):
    """`num_tokens` rounded up to whole pages (the tokens its pages hold)."""
    return cdiv(num_tokens, page_size) * page_size


def output_room(pool_tokens: int, input_len: int, page_size: int) -> int:
    """The most output tokens a pool of `pool_tokens` holds beside a prompt of `input_len`: the
    prompt's pages, one page and one token kept back (SGLang 0.5.23's max_new_tokens_for_memory;
    never below 0)."""
    return max(0, pool_tokens - align_up(input_len, page_size) - page_size - 1)


def extend_new_pages(prefix_lens_cpu: "torch.Tensor | list[int]", seq_lens_cpu: "torch.Tensor | list[int]",
                     page_size: int, extend_num_tokens: int | None = None) -> int:
    """Pages an extend batch opens: exact per request (`cdiv(seq) - cdiv(prefix)`), not one
    page per request. With page size 1 that is the new tokens (`extend_num_tokens`, when the
    caller knows it, answers at once). The lengths as lists of ints (a batch is a few
    requests: plain sums) or CPU tensors (numpy over them: no device work)."""
    if page_size == 1 and extend_num_tokens is not None:
        return extend_num_tokens
    if isinstance(prefix_lens_cpu, list):
        return sum(cdiv(s, page_size) - cdiv(p, page_size) for p, s in zip(prefix_lens_cpu, seq_lens_cpu))
    pre, seq = prefix_lens_cpu.numpy(), seq_lens_cpu.numpy()
    if page_size == 1:
        return int(seq.sum() - pre.sum())
    return int(cdiv(seq, page_size).sum() - cdiv(pre, page_size).sum())


def decode_new_pages(seq_lens_cpu: torch.Tensor, page_size: int) -> int:
    """Pages the next decode step opens: requests whose new position starts a page.

    `seq_lens_cpu` are the lengths *before* the step (see the module docstring). Counted
    with numpy on the CPU twin: no device work and no host sync.
    """
    if page_size == 1:
        return int(seq_lens_cpu.numel())
    return int(np.count_nonzero(seq_lens_cpu.numpy() % page_size == 0))
