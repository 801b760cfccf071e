"""Per-step checks of the paged memory layout: request rows, page sharing, the free list.

Run between two scheduler steps over the requests that hold memory (the running batch and
the request being chunked). Every check reads, none mutates; each returns the numbers behind
its verdict and, when it fails, a `Violation` that names the request, the positions and the
slots involved. Pages are the allocator's pages (single slots when page_size == 1).

    row_layout    position t of a row sits at offset t % page_size of its page, and
                  consecutive positions on one page hold consecutive slots   (DESIGN 2.2)
    slot_range    every slot a request holds is a KV row: not page 0, below kv_pool.rows (2.1)
    page_sharing  a page is held by one request at most, never by a request and the tree;
                  a request's cached prefix [0, last_matched_prefix_len) is tree pages (2.2)
    free_list     no duplicate, no page 0, nothing the tree or a request holds        (2.3)
    no_lost_page  every page is free, cached in the tree, or held by one request      (2.3)
    conservation  available + evictable + protected + held == size, tokens and pages  (2.3)
    tree          the prefix cache's own integrity walk                               (2.4)
    idle          nothing running: every request row free, available + evictable == size (2.6)

A request row, in positions (tree_len = last_matched_prefix_len, page aligned):

    [0, tree_len)                  slots of tree pages (shared through the tree, locked)
    [tree_len, kv_allocated_len)   the request's own pages, the last one possibly partial
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Iterable, NamedTuple, Optional

import numpy as np

from memcli.mem_cache.check import conservation
from memcli.mem_cache.integrity import Check

CHECK_NAMES = (
    "row_layout",
    "slot_range",
    "page_sharing",
    "free_list",
    "no_lost_page",
    "conservation",
    "tree",
    "idle",
)


@dataclass(frozen=True)
class Violation:
    """The first thing a check found wrong. `step` is filled in by whoever ran the check."""

    check: str
    detail: str
    rid: Optional[str] = None
    positions: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()
    step: Optional[int] = None

    def at_step(self, step: int) -> "Violation":
        return replace(self, step=step)

    def to_dict(self) -> dict:
        return {"check": self.check, "step": self.step, "rid": self.rid, "positions": list(self.positions),
                "slots": list(self.slots), "detail": self.detail}


class Outcome(NamedTuple):
    """A check's verdict with its numbers, and the violation when it failed."""

    check: Check
    violation: Optional[Violation]


@dataclass(frozen=True)
class RequestRow:
    """One request's row of req_to_token, positions [0, kv_allocated_len), on the host."""

    rid: str
    slots: np.ndarray
    tree_len: int


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
    rows: list[RequestRow]
    tree_slots: np.ndarray
    free_pages: np.ndarray

    @cached_property
    def tree_pages(self) -> np.ndarray:
        return np.unique(self.tree_slots // self.page_size)

    @cached_property
    def owned(self) -> OwnedRuns:
        """Every run of own positions per page, in row order (a page appears once per run)."""
        parts = []
        for index, row in enumerate(self.rows):
            pages = row.slots[row.tree_len:] // self.page_size
            if not len(pages):
                continue
            starts = np.flatnonzero(np.r_[True, pages[1:] != pages[:-1]])
            ends = np.r_[starts[1:], len(pages)] - 1
            parts.append((pages[starts], np.full(len(starts), index), row.tree_len + starts, row.tree_len + ends))
        if not parts:
            empty = np.empty(0, np.int64)
            return OwnedRuns(empty, empty, empty, empty)
        return OwnedRuns(*(np.concatenate(column) for column in zip(*parts)))


def active_rows(stack: Any, reqs: Iterable[Any]) -> list[RequestRow]:
    """Rows of the requests that hold memory (a row, something allocated, not yet freed)."""
    table = stack.req_to_token_pool.req_to_token
    rows = []
    for req in reqs:
        if req.kv_freed or req.req_pool_idx is None or req.kv_allocated_len <= 0:
            continue
        slots = table[req.req_pool_idx, : req.kv_allocated_len].cpu().numpy().astype(np.int64)
        rows.append(RequestRow(str(req.rid), slots, int(req.last_matched_prefix_len)))
    return rows


def take_layout(stack: Any, reqs: Iterable[Any]) -> Layout:
    allocator, tree = stack.allocator, stack.tree_cache
    flatten = getattr(tree, "all_values_flatten", None)
    tree_slots = flatten().cpu().numpy().astype(np.int64) if flatten is not None else np.empty(0, np.int64)
    return Layout(
        page_size=allocator.page_size,
        num_pages=allocator.num_pages,
        kv_rows=stack.kv_pool.rows,
        rows=active_rows(stack, reqs),
        tree_slots=tree_slots,
        free_pages=allocator.free_page_ids().cpu().numpy().astype(np.int64),
    )


def run_page_checks(stack: Any, reqs: Iterable[Any]) -> list[Outcome]:
    """All checks in `CHECK_NAMES` order over the requests `reqs` that hold memory."""
    reqs = list(reqs)
    layout = take_layout(stack, reqs)
    return [
        check_row_layout(layout),
        check_slot_range(layout),
        check_page_sharing(layout),
        check_free_list(layout),
        check_no_lost_page(layout),
        check_conservation(stack, reqs),
        check_tree(stack),
        check_idle(stack, layout),
    ]


def failures(outcomes: Iterable[Outcome]) -> list[Violation]:
    return [o.violation for o in outcomes if o.violation is not None]


def _passed(name: str, detail: str) -> Outcome:
    return Outcome(Check(name, True, detail), None)


def _failed(violation: Violation) -> Outcome:
    return Outcome(Check(violation.check, False, violation.detail), violation)


def _page_slots(page: int, page_size: int) -> str:
    if page_size == 1:
        return f"slot {page}"
    return f"slots {page * page_size}..{page * page_size + page_size - 1}"


# -- rows -------------------------------------------------------------------------------------


def check_row_layout(layout: Layout) -> Outcome:
    """Slot of position t at offset t % ps; consecutive positions on a page, consecutive slots."""
    ps = layout.page_size
    positions = 0
    for row in layout.rows:
        slots = row.slots
        t = np.arange(len(slots))
        positions += len(slots)
        if ps == 1:
            continue
        bad_offset = slots % ps != t % ps
        bad_run = np.r_[False, (t[1:] % ps != 0) & (slots[1:] != slots[:-1] + 1)]
        bad = np.flatnonzero(bad_offset | bad_run)
        if not len(bad):
            continue
        pos = int(bad[0])
        slot = int(slots[pos])
        if bad_offset[pos]:
            detail = (f"request {row.rid} position {pos}: slot {slot} sits at offset {slot % ps} of page"
                      f" {slot // ps}, expected offset {pos % ps} (= {pos} % {ps})")
            return _failed(Violation("row_layout", detail, row.rid, (pos,), (slot,)))
        prev = int(slots[pos - 1])
        detail = (f"request {row.rid} positions {pos - 1} and {pos} are on one page but hold slots {prev} and"
                  f" {slot}, expected {prev + 1}")
        return _failed(Violation("row_layout", detail, row.rid, (pos - 1, pos), (prev, slot)))
    return _passed("row_layout", f"{len(layout.rows)} request rows, {positions} positions at offset t % {ps}")


def check_slot_range(layout: Layout) -> Outcome:
    """Every held slot is past page 0 and inside both the allocator's pages and the KV buffer."""
    ps = layout.page_size
    end = min((layout.num_pages + 1) * ps, layout.kv_rows)
    for row in layout.rows:
        bad = np.flatnonzero((row.slots < ps) | (row.slots >= end))
        if not len(bad):
            continue
        pos = int(bad[0])
        slot = int(row.slots[pos])
        if slot < ps:
            why = f"is on page 0 (padding, slots 0..{ps - 1})"
        elif slot >= layout.kv_rows:
            why = f"is beyond the KV buffer, which has {layout.kv_rows} rows"
        else:
            why = f"is beyond the allocator's {layout.num_pages} pages (last slot {(layout.num_pages + 1) * ps - 1})"
        detail = f"request {row.rid} position {pos} holds slot {slot}, which {why}"
        return _failed(Violation("slot_range", detail, row.rid, (pos,), (slot,)))
    return _passed("slot_range", f"every held slot in [{ps}, {end}) (KV buffer {layout.kv_rows} rows)")


def check_page_sharing(layout: Layout) -> Outcome:
    """No page held twice outside the tree; cached prefixes point at tree pages."""
    ps = layout.page_size
    runs = layout.owned_runs()
    rows = layout.rows
    by_page: dict[int, OwnedRun] = {}
    for run in runs:
        other = by_page.setdefault(run.page, run)
        if other is run:
            continue
        a, b = rows[other.row], rows[run.row]
        who = "again" if other.row == run.row else f"and request {b.rid}"
        detail = (f"page {run.page} ({_page_slots(run.page, ps)}) is held by request {a.rid} at positions"
                  f" {other.first}..{other.last} {who} at positions {run.first}..{run.last}, outside the tree")
        return _failed(Violation("page_sharing", detail, a.rid, (other.first, run.first),
                                 (int(a.slots[other.first]), int(b.slots[run.first]))))
    tree_pages = layout.tree_pages
    for run in runs:
        if tree_pages.size and np.isin(run.page, tree_pages):
            row = rows[run.row]
            detail = (f"page {run.page} is held by request {row.rid} at positions {run.first}..{run.last}"
                      f" (its own part) and also cached in the tree")
            return _failed(Violation("page_sharing", detail, row.rid, (run.first,), (int(row.slots[run.first]),)))
    prefix_positions = 0
    for row in rows:
        prefix_pages = row.slots[: row.tree_len] // ps
        prefix_positions += row.tree_len
        bad = np.flatnonzero(~np.isin(prefix_pages, tree_pages))
        if len(bad):
            pos = int(bad[0])
            slot = int(row.slots[pos])
            detail = (f"request {row.rid} position {pos} is in its cached prefix (< {row.tree_len}) but points at"
                      f" slot {slot} on page {slot // ps}, which the tree does not hold")
            return _failed(Violation("page_sharing", detail, row.rid, (pos,), (slot,)))
    return _passed("page_sharing", f"{len(by_page)} pages held by one request each, {prefix_positions} prefix"
                                   f" positions on {len(tree_pages)} tree pages")


# -- free list and accounting ----------------------------------------------------------------


def check_free_list(layout: Layout) -> Outcome:
    """No duplicate, no page 0 or out-of-range page, nothing held by the tree or a request."""
    ps, free = layout.page_size, layout.free_pages
    unit = "page" if ps > 1 else "slot"
    pages, counts = np.unique(free, return_counts=True)
    if len(pages) and pages[0] <= 0:
        detail = f"{unit} {int(pages[0])} (padding) is in the free list"
        return _failed(Violation("free_list", detail, slots=(int(pages[0]) * ps,)))
    if len(pages) and pages[-1] > layout.num_pages:
        detail = f"{unit} {int(pages[-1])} is in the free list but the allocator has {layout.num_pages} {unit}s"
        return _failed(Violation("free_list", detail, slots=(int(pages[-1]) * ps,)))
    dup = np.flatnonzero(counts > 1)
    if len(dup):
        page = int(pages[dup[0]])
        detail = (f"{unit} {page} ({_page_slots(page, ps)}) is in the free list {int(counts[dup[0]])} times"
                  f" (freed twice); {len(dup)} duplicated {unit}s")
        return _failed(Violation("free_list", detail, slots=(page * ps,)))
    for run in layout.owned_runs():
        if np.isin(run.page, pages):
            row = layout.rows[run.row]
            detail = (f"{unit} {run.page} ({_page_slots(run.page, ps)}) is in the free list but request {row.rid}"
                      f" holds it at positions {run.first}..{run.last}")
            return _failed(Violation("free_list", detail, row.rid, (run.first, run.last),
                                     (int(row.slots[run.first]), int(row.slots[run.last]))))
    tree_pages = layout.tree_pages
    both = tree_pages[np.isin(tree_pages, pages)]
    if len(both):
        page = int(both[0])
        detail = (f"{unit} {page} ({_page_slots(page, ps)}) is in the free list but the tree caches it;"
                  f" {len(both)} tree {unit}s are free")
        return _failed(Violation("free_list", detail, slots=(page * ps,)))
    return _passed("free_list", f"{len(free)} free {unit}s: no duplicate, none held")


def check_no_lost_page(layout: Layout) -> Outcome:
    """Every page 1..num_pages is free, cached in the tree, or held by a running request."""
    accounted = np.zeros(layout.num_pages + 1, dtype=bool)
    for pages in (layout.free_pages, layout.tree_pages, np.array([r.page for r in layout.owned_runs()], np.int64)):
        pages = pages[(pages >= 0) & (pages <= layout.num_pages)]
        accounted[pages] = True
    lost = np.flatnonzero(~accounted[1:]) + 1
    unit = "page" if layout.page_size > 1 else "slot"
    if len(lost):
        page = int(lost[0])
        detail = (f"{len(lost)} {unit}s are neither free, nor cached, nor held by a request (lost), first {unit}"
                  f" {page} ({_page_slots(page, layout.page_size)})")
        return _failed(Violation("no_lost_page", detail, slots=(page * layout.page_size,)))
    return _passed("no_lost_page", f"all {layout.num_pages} {unit}s free, cached or held")


def check_conservation(stack: Any, reqs: list) -> Outcome:
    """available + evictable + protected + held == size, in tokens and pages; rows in use."""
    report = conservation(stack, reqs)
    checks = [c for c in report.checks if not c.name.startswith("idle")]
    bad = [c for c in checks if not c.ok]
    detail = "; ".join(f"{c.name}: {c.detail}" for c in (bad or checks[:1]))
    if bad:
        return _failed(Violation("conservation", detail))
    return _passed("conservation", detail)


def check_tree(stack: Any) -> Outcome:
    """The prefix cache's own `check_integrity()` (sizes, locks, page-aligned nodes, ownership)."""
    report = stack.tree_cache.check_integrity()
    if not report.ok:
        detail = f"{report.component}: " + "; ".join(f"{c.name}: {c.detail}" for c in report.failures)
        return _failed(Violation("tree", detail))
    return _passed("tree", f"{report.component}: {len(report.checks)} checks hold")


def check_idle(stack: Any, layout: Layout) -> Outcome:
    """With no request holding memory: no request row in use, available + evictable == size."""
    if layout.rows:
        return _passed("idle", f"not idle ({len(layout.rows)} requests hold memory)")
    allocator, tree, pool = stack.allocator, stack.tree_cache, stack.req_to_token_pool
    rows_used = pool.size - pool.available_size()
    avail, evictable, protected = allocator.available_size(), tree.evictable_size(), tree.protected_size()
    detail = (f"{rows_used} request rows in use; available {avail} + evictable {evictable} vs size"
              f" {allocator.size}; protected {protected}")
    if rows_used or protected or avail + evictable != allocator.size:
        return _failed(Violation("idle", "idle but not everything is free: " + detail))
    return _passed("idle", detail)
