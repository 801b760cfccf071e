"""Random *valid* inputs for the memory-path kernels (shared by the tests and the self-check).

Valid means what the allocator guarantees in a real run: every request owns distinct pages
(page 0 is never used), position ``t`` of a request sits at offset ``t % page_size`` of its
page, ``last_loc`` is the slot of the last prefix token, and ``free_pages`` holds distinct
pages that no prefix owns, at least as many as the batch needs.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from ._common import cdiv


class ExtendCase(NamedTuple):
    prefix_lens: torch.Tensor
    seq_lens: torch.Tensor
    last_loc: torch.Tensor
    free_pages: torch.Tensor
    page_size: int
    extend_num_tokens: int
    prefix_slots: List[torch.Tensor]  # each request's prefix slots (int64), ending at last_loc

    @property
    def prefix_flat(self) -> torch.Tensor:
        device = self.prefix_lens.device
        return torch.cat([torch.empty(0, dtype=torch.int64, device=device), *self.prefix_slots])


class DecodeCase(NamedTuple):
    seq_lens_before: torch.Tensor
    req_pool_indices: torch.Tensor
    req_to_token: torch.Tensor
    free_pages: torch.Tensor
    page_size: int

    @property
    def last_loc(self) -> torch.Tensor:
        """Slot of token ``seq_before - 1`` (-1 for an empty sequence)."""
        rows = self.req_to_token[self.req_pool_indices].to(torch.int64)
        cols = (self.seq_lens_before - 1).clamp(min=0)
        last = rows.gather(1, cols[:, None])[:, 0]
        return torch.where(self.seq_lens_before > 0, last, -1)


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    """Uniform int in ``[low, high]``."""
    return int(torch.randint(low, high + 1, (1,), generator=gen))


def _random_prefix_len(gen, page_size, max_prefix_len):
    kind = _randint(gen, 0, 2)
    if kind == 0 or max_prefix_len == 0:
        return 0
    if kind == 1 and max_prefix_len >= page_size:  # page aligned
        return page_size * _randint(gen, 1, max_prefix_len // page_size)
    return _randint(gen, 1, max_prefix_len)  # usually ends mid-page


def _random_extend_len(gen, prefix_len, page_size, max_extend_len):
    room_in_page = cdiv(prefix_len, page_size) * page_size - prefix_len
    if room_in_page > 0 and _randint(gen, 0, 3) == 0:  # stays inside the prefix's last page
        return _randint(gen, 1, min(room_in_page, max_extend_len))
    if _randint(gen, 0, 3) == 0:  # stays inside one new page
        return _randint(gen, 1, min(page_size, max_extend_len))
    return _randint(gen, 1, max_extend_len)


def _page_slots(pages: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    t = torch.arange(length, dtype=torch.int64)
    return pages[t // page_size] * page_size + t % page_size


def _split_pages(gen, lengths, page_size, num_free_pages):
    """Distinct shuffled pages: one list per length (enough to hold it), then the free list."""
    owned = [cdiv(n, page_size) for n in lengths]
    pages = torch.randperm(sum(owned) + num_free_pages, generator=gen) + 1  # never page 0
    per_request = list(torch.split(pages[: sum(owned)], owned))
    return per_request, pages[sum(owned):]


def random_extend_case(
    gen: torch.Generator,
    bs: int,
    page_size: int,
    max_prefix_len: int = 100,
    max_extend_len: int = 100,
    spare_pages: int = 3,
    device: Optional[torch.device] = None,
) -> ExtendCase:
    """A valid extend batch (``alloc_extend_write``'s input) mixing empty, page-aligned and mid-page prefixes.

    Prefix lengths are at most ``max_prefix_len``, extend lengths in ``[1, max_extend_len]``.
    """
    prefix_lens = [_random_prefix_len(gen, page_size, max_prefix_len) for _ in range(bs)]
    extend_lens = [_random_extend_len(gen, p, page_size, max_extend_len) for p in prefix_lens]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    new_pages = sum(cdiv(s, page_size) - cdiv(p, page_size) for p, s in zip(prefix_lens, seq_lens))
    owned, free_pages = _split_pages(gen, prefix_lens, page_size, new_pages + spare_pages)
    prefix_slots = [_page_slots(pages, p, page_size) for pages, p in zip(owned, prefix_lens)]
    last_loc = [int(s[-1]) if len(s) else -1 for s in prefix_slots]

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ExtendCase(
        prefix_lens=as_tensor(prefix_lens),
        seq_lens=as_tensor(seq_lens),
        last_loc=as_tensor(last_loc),
        free_pages=free_pages.to(device),
        page_size=page_size,
        extend_num_tokens=sum(extend_lens),
        prefix_slots=[s.to(device) for s in prefix_slots],
    )


def random_decode_case(
    gen: torch.Generator,
    bs: int,
    page_size: int,
    max_len: int = 100,
    spare_pages: int = 3,
    spare_rows: int = 3,
    device: Optional[torch.device] = None,
) -> DecodeCase:
    """A valid decode batch: filled ``req_to_token`` rows, lengths hitting page boundaries often."""
    seq_lens = []
    for _ in range(bs):
        if _randint(gen, 0, 2) == 0:  # the new token opens a page
            seq_lens.append(page_size * _randint(gen, 0, max(max_len // page_size, 1)))
        else:
            seq_lens.append(_randint(gen, 0, max_len))
    owned, free_pages = _split_pages(gen, seq_lens, page_size, bs + spare_pages)
    num_rows = bs + spare_rows
    rows = torch.randperm(num_rows, generator=gen)[:bs]
    # Unused cells hold a sentinel so tests can see that nothing else was written.
    req_to_token = torch.full((num_rows, max(seq_lens) + 1 + _randint(gen, 0, 3)), -7,
                              dtype=torch.int32)
    for row, pages, n in zip(rows.tolist(), owned, seq_lens):
        req_to_token[row, :n] = _page_slots(pages, n, page_size).to(torch.int32)
    return DecodeCase(
        seq_lens_before=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        req_pool_indices=rows.to(device),
        req_to_token=req_to_token.to(device),
        free_pages=free_pages.to(device),
        page_size=page_size,
    )
