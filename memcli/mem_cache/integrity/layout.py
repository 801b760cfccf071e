"""Page-layout checks over one host copy of the paged memory (`Layout`), taken once per step.

Every check reads, none mutates; each answers a `CheckResult` with the numbers behind its
verdict and, when it fails, the request, positions and slots involved. Pages are the
allocator's pages (single slots when page_size == 1).

    row_layout    position t of a row sits at offset t % page_size of its page, and
                  consecutive positions on one page hold consecutive slots   (DESIGN 2.2)
    slot_range    every slot a request holds is a KV row: not page 0, below kv_pool.rows (2.1)
    page_sharing  a page is held by one request at most, never by a request and the tree;
                  a request's cached prefix [0, last_matched_prefix_len) is tree pages (2.2)
    free_list     no duplicate, no page 0, nothing the tree or a request holds        (2.3)
    no_lost_page  every page is free, cached in the tree, or held by one request      (2.3)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, NamedTuple, Optional

import numpy as np

from memcli.check_result import CheckResult, failed, passed
from memcli.mem_cache.integrity.requests import Rows, take_rows


class OwnedRuns(NamedTuple):
    """Runs of consecutive own positions [first, last] of one request on one page (arrays)."""

    page: np.ndarray
    row: np.ndarray
    first: np.ndarray
    last: np.ndarray


@dataclass(frozen=True)
class Layout:
    """Host copy of everything the checks read, taken once per step."""

    page_size: int
    num_pages: int
    kv_rows: int
    rows: Rows
    tree_slots: np.ndarray
    free_pages: np.ndarray

    @cached_property
    def tree_mask(self) -> np.ndarray:
        return self.page_mask(self.tree_slots // self.page_size)

    @cached_property
    def tree_pages(self) -> np.ndarray:
        """Pages holding cached slots, sorted (ids out of range dropped: slot_range reports those)."""
        return np.flatnonzero(self.tree_mask)

    @cached_property
    def free_mask(self) -> np.ndarray:
        return self.page_mask(self.free_pages)

    def page_mask(self, pages: np.ndarray) -> np.ndarray:
        """Boolean array over page ids 0..num_pages, True for `pages` (ids out of range ignored)."""
        mask = np.zeros(self.num_pages + 1, dtype=bool)
        mask[pages[(pages >= 0) & (pages <= self.num_pages)]] = True
        return mask

    def lookup(self, mask: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """`mask[pages]`, False where a page id is out of range."""
        inside = (pages >= 0) & (pages <= self.num_pages)
        out = np.zeros(len(pages), dtype=bool)
        out[inside] = mask[pages[inside]]
        return out

    @cached_property
    def owned(self) -> OwnedRuns:
        """Every run of own positions on one page, in row order (a page appears once per run)."""
        rows = self.rows
        index = np.flatnonzero(rows.own)
        if not len(index):
            empty = np.empty(0, np.int64)
            return OwnedRuns(empty, empty, empty, empty)
        pages, row, pos = rows.slots[index] // self.page_size, rows.row[index], rows.pos[index]
        change = np.ones(len(index), dtype=bool)
        change[1:] = (row[1:] != row[:-1]) | (pages[1:] != pages[:-1])
        starts = np.flatnonzero(change)
        ends = np.append(starts[1:], len(index)) - 1
        return OwnedRuns(pages[starts], row[starts], pos[starts], pos[ends])


def take_layout(stack: Any, reqs: Iterable[Any]) -> Layout:
    allocator, tree = stack.allocator, stack.tree_cache
    flatten = getattr(tree, "all_values_flatten", None)
    tree_slots = flatten().cpu().numpy().astype(np.int64) if flatten is not None else np.empty(0, np.int64)
    return Layout(
        page_size=allocator.page_size,
        num_pages=allocator.num_pages,
        kv_rows=stack.kv_pool.rows,
        rows=take_rows(stack, reqs),
        tree_slots=tree_slots,
        free_pages=allocator.free_page_ids().cpu().numpy().astype(np.int64),
    )



def _page_slots(page: int, page_size: int) -> str:
    if page_size == 1:
        return f"slot {page}"
    return f"slots {page * page_size}..{page * page_size + page_size - 1}"


# -- rows -------------------------------------------------------------------------------------


def check_row_layout(layout: Layout) -> CheckResult:
    """Slot of position t at offset t % ps; consecutive positions on a page, consecutive slots."""
    ps, rows = layout.page_size, layout.rows
    detail = f"{len(rows)} request rows, {len(rows.slots)} positions at offset t % {ps}"
    if ps == 1 or not len(rows.slots):
        return passed("row_layout", detail)
    slots, pos = rows.slots, rows.pos
    bad_offset = slots % ps != pos % ps
    bad_run = np.zeros(len(slots), dtype=bool)
    bad_run[1:] = (rows.row[1:] == rows.row[:-1]) & (pos[1:] % ps != 0) & (slots[1:] != slots[:-1] + 1)
    bad = np.flatnonzero(bad_offset | bad_run)
    if not len(bad):
        return passed("row_layout", detail)
    i = int(bad[0])
    rid, t, slot = rows.rids[rows.row[i]], int(pos[i]), int(slots[i])
    if bad_offset[i]:
        detail = (f"request {rid} position {t}: slot {slot} sits at offset {slot % ps} of page {slot // ps},"
                  f" expected offset {t % ps} (= {t} % {ps})")
        return failed("row_layout", detail, rid, (t,), (slot,))
    prev = int(slots[i - 1])
    detail = (f"request {rid} positions {t - 1} and {t} are on one page but hold slots {prev} and {slot},"
              f" expected {prev + 1}")
    return failed("row_layout", detail, rid, (t - 1, t), (prev, slot))


def check_slot_range(layout: Layout) -> CheckResult:
    """Every held slot is past page 0 and inside both the allocator's pages and the KV buffer."""
    ps, rows = layout.page_size, layout.rows
    end = min((layout.num_pages + 1) * ps, layout.kv_rows)
    bad = np.flatnonzero((rows.slots < ps) | (rows.slots >= end))
    if not len(bad):
        return passed("slot_range", f"every held slot in [{ps}, {end}) (KV buffer {layout.kv_rows} rows)")
    i = int(bad[0])
    rid, t, slot = rows.rids[rows.row[i]], int(rows.pos[i]), int(rows.slots[i])
    if slot < ps:
        why = f"is on page 0 (padding, slots 0..{ps - 1})"
    elif slot >= layout.kv_rows:
        why = f"is past the end of the KV buffer ({layout.kv_rows} rows, last row {layout.kv_rows - 1})"
    else:
        why = f"is beyond the allocator's {layout.num_pages} pages (last slot {(layout.num_pages + 1) * ps - 1})"
    detail = f"request {rid} position {t} holds slot {slot}, which {why}"
    return failed("slot_range", detail, rid, (t,), (slot,))


def _shared_runs(pages: np.ndarray, num_pages: int) -> Optional[tuple[int, int]]:
    """Indices of the first two runs on the same page, or None when every page appears once.

    Page ids out of range are left out (slot_range reports them)."""
    inside = np.flatnonzero((pages >= 0) & (pages <= num_pages))
    if not len(inside):
        return None
    counts = np.bincount(pages[inside], minlength=num_pages + 1)
    if counts.max() < 2:
        return None
    first_dup = inside[counts[pages[inside]] > 1]
    i = int(first_dup[0])
    j = int(first_dup[pages[first_dup] == pages[i]][1])
    return i, j


def check_page_sharing(layout: Layout) -> CheckResult:
    """No page held twice outside the tree; cached prefixes point at tree pages."""
    ps, rows, runs = layout.page_size, layout.rows, layout.owned
    shared = _shared_runs(runs.page, layout.num_pages)
    if shared is not None:
        i, j = shared
        page, a, b = int(runs.page[i]), int(runs.row[i]), int(runs.row[j])
        who = "again" if a == b else f"and request {rows.rids[b]}"
        detail = (f"page {page} ({_page_slots(page, ps)}) is held by request {rows.rids[a]} at positions"
                  f" {runs.first[i]}..{runs.last[i]} {who} at positions {runs.first[j]}..{runs.last[j]},"
                  " outside the tree")
        first_i, first_j = int(runs.first[i]), int(runs.first[j])
        return failed("page_sharing", detail, rows.rids[a], (first_i, first_j),
                      (rows.slot(a, first_i), rows.slot(b, first_j)))
    cached = np.flatnonzero(layout.lookup(layout.tree_mask, runs.page))
    if len(cached):
        i = int(cached[0])
        row, first = int(runs.row[i]), int(runs.first[i])
        detail = (f"page {int(runs.page[i])} is held by request {rows.rids[row]} at positions {first}..{runs.last[i]}"
                  " (its own part) and is also cached in the tree")
        return failed("page_sharing", detail, rows.rids[row], (first,), (rows.slot(row, first),))
    prefix = np.flatnonzero(~rows.own)
    outside = prefix[~layout.lookup(layout.tree_mask, rows.slots[prefix] // ps)]
    if len(outside):
        i = int(outside[0])
        row, t, slot = int(rows.row[i]), int(rows.pos[i]), int(rows.slots[i])
        detail = (f"request {rows.rids[row]} position {t} is in its cached prefix (< {rows.tree_lens[row]}) but"
                  f" points at slot {slot} on page {slot // ps}, which the tree does not hold")
        return failed("page_sharing", detail, rows.rids[row], (t,), (slot,))
    return passed("page_sharing", f"{len(runs.page)} pages held by one request each; {len(prefix)} prefix"
                                   f" positions on {len(layout.tree_pages)} tree pages")


# -- free list and lost pages ----------------------------------------------------------------


def check_free_list(layout: Layout) -> CheckResult:
    """No duplicate, no page 0 or out-of-range page, nothing held by the tree or a request."""
    ps, free = layout.page_size, layout.free_pages
    unit = "page" if ps > 1 else "slot"
    pages, counts = np.unique(free, return_counts=True)
    if len(pages) and pages[0] <= 0:
        detail = f"{unit} {int(pages[0])} (padding) is in the free list"
        return failed("free_list", detail, slots=(int(pages[0]) * ps,))
    if len(pages) and pages[-1] > layout.num_pages:
        detail = f"{unit} {int(pages[-1])} is in the free list but the allocator has {layout.num_pages} {unit}s"
        return failed("free_list", detail, slots=(int(pages[-1]) * ps,))
    dup = np.flatnonzero(counts > 1)
    if len(dup):
        page = int(pages[dup[0]])
        detail = (f"{unit} {page} ({_page_slots(page, ps)}) is in the free list {int(counts[dup[0]])} times"
                  f" (freed twice); {len(dup)} duplicated {unit}s")
        return failed("free_list", detail, slots=(page * ps,))
    runs, rows = layout.owned, layout.rows
    held = np.flatnonzero(layout.lookup(layout.free_mask, runs.page))
    if len(held):
        i = int(held[0])
        page, row, first, last = int(runs.page[i]), int(runs.row[i]), int(runs.first[i]), int(runs.last[i])
        detail = (f"{unit} {page} ({_page_slots(page, ps)}) is in the free list but request {rows.rids[row]} holds"
                  f" it at positions {first}..{last}")
        return failed("free_list", detail, rows.rids[row], (first, last),
                      (rows.slot(row, first), rows.slot(row, last)))
    tree_pages = layout.tree_pages
    both = tree_pages[layout.lookup(layout.free_mask, tree_pages)]
    if len(both):
        page = int(both[0])
        detail = (f"{unit} {page} ({_page_slots(page, ps)}) is in the free list but the tree caches it;"
                  f" {len(both)} tree {unit}s are free")
        return failed("free_list", detail, slots=(page * ps,))
    return passed("free_list", f"{len(free)} free {unit}s: no duplicate, none held")


def check_no_lost_page(layout: Layout) -> CheckResult:
    """Every page 1..num_pages is free, cached in the tree, or held by a running request."""
    accounted = layout.free_mask | layout.tree_mask | layout.page_mask(layout.owned.page)
    lost = np.flatnonzero(~accounted[1:]) + 1
    unit = "page" if layout.page_size > 1 else "slot"
    if len(lost):
        page = int(lost[0])
        detail = (f"{len(lost)} {unit}s are neither free, nor cached, nor held by a request (lost), first {unit}"
                  f" {page} ({_page_slots(page, layout.page_size)})")
        return failed("no_lost_page", detail, slots=(page * layout.page_size,))
    return passed("no_lost_page", f"all {layout.num_pages} {unit}s free, cached or held")
