"""The per-step incremental check: O(what the step changed + running requests), not O(pool).

Reads the `OwnershipLedger` (kept up to date by the operations) and the request rows written
during the step (`ledger.dirty`), never the whole pool:

    lost_page     no page is out of the allocator without an owner (allocated, never claimed;
                  released, never freed)                                     (DESIGN 2.3)
    free_list     the ledger's free pages == the allocator's free count         (2.3)
    tree          the ledger's tree pages == the tree's size; evictable + protected == total (2.4)
    conservation  every running request owns exactly the pages it holds; carried pages belong
                  to a request between chunks                                   (2.3)
    row_layout    positions written this step sit at offset t % page_size, consecutively (2.2)
    slot_range    slots written this step are pool pages (not page 0)          (2.1)
    page_sharing  a written position below the request's tree part is a tree page, above it the
                  request's own page                                            (2.2)
    host_tier     (hiradix only) host pool conservation by counters, copies in flight locked
                  (`integrity.hicache`)
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Iterable, NamedTuple

import numpy as np
import torch

from memcli.mem_cache.integrity.hicache import host_tier_step_check
from memcli.mem_cache.integrity.ownership import CARRIED, FREE, IN_FLIGHT, LOOSE, TREE, OwnershipLedger, owner_name
from memcli.mem_cache.integrity.requests import InFlightSlot
from memcli.mem_cache.integrity.result import CheckResult, failed, passed

INCREMENTAL_NAMES = ("lost_page", "free_list", "tree", "conservation", "row_layout", "slot_range", "page_sharing")


def check_step(ledger: OwnershipLedger, stack: Any, running: Iterable[Any]) -> list[CheckResult]:
    """Every incremental check, in `INCREMENTAL_NAMES` order; clears the step's dirty rows."""
    ledger.settle()  # pages handed out and never claimed are LOOSE (lost) from here on
    running = list(running)
    reqs = [r for r in running if not r.kv_freed and r.__class__ is not InFlightSlot]
    num_flying = sum(1 for r in running if isinstance(r, InFlightSlot)) if len(reqs) < len(running) else 0
    held = _Held.of(reqs, ledger.page_size)
    results = [_lost_pages(ledger), _free_count(ledger, stack), _tree_count(ledger, stack),
               _held(ledger, held, num_flying), *_written_rows(ledger, stack, held)]
    if stack.tree_cache.host_tier() is not None:
        results.append(host_tier_step_check(stack.tree_cache))
    ledger.dirty = []
    return results


_ALLOCATED, _TREE_LEN = attrgetter("kv_allocated_len"), attrgetter("last_matched_prefix_len")


class _Held(NamedTuple):
    """The running requests as arrays: row (-1 without one), allocated and tree lengths, pages held."""

    reqs: list
    rows: np.ndarray
    allocated: np.ndarray
    tree_len: np.ndarray
    pages: np.ndarray

    @classmethod
    def of(cls, reqs: list, page_size: int) -> "_Held":
        n = len(reqs)
        rows = np.array([-1 if r.req_pool_idx is None else r.req_pool_idx for r in reqs], dtype=np.int64)
        allocated = np.fromiter(map(_ALLOCATED, reqs), np.int64, n)
        tree_len = np.fromiter(map(_TREE_LEN, reqs), np.int64, n)
        pages = -(-allocated // page_size) - tree_len // page_size
        return cls(reqs, rows, allocated, tree_len, pages)


def _lost_pages(ledger: OwnershipLedger) -> CheckResult:
    loose = ledger.counts[LOOSE]
    if not loose:
        return passed("lost_page", "every page out of the allocator has an owner")
    pages = np.flatnonzero(ledger.owner == LOOSE)  # O(pool), only on the way to a failure
    what = ", ".join(ledger._what(int(p)) for p in pages[:3])
    return failed("lost_page", f"memory leak detected: {loose} pages are out of the allocator but owned by nobody"
                               f" (allocated and never claimed, or released and never freed), e.g. {what}",
                  slots=tuple(int(p) for p in pages[:8]))


def _free_count(ledger: OwnershipLedger, stack: Any) -> CheckResult:
    alloc = stack.allocator
    free, avail = ledger.counts[FREE], alloc.available_size() // alloc.page_size
    detail = f"ledger {free} free pages, allocator {avail}"
    return passed("free_list", detail) if free == avail else failed("free_list", detail + " (a duplicate or a lost free)")


def _tree_count(ledger: OwnershipLedger, stack: Any) -> CheckResult:
    tree, ps = stack.tree_cache, ledger.page_size
    total, evictable, protected = tree.total_size(), tree.evictable_size(), tree.tree_protected_size()
    owned = ledger.counts[TREE] * ps
    detail = f"ledger {owned} tree tokens, tree total {total} (evictable {evictable} + protected {protected})"
    if hasattr(tree, "all_values_flatten"):
        ok = owned == total and evictable + protected == total
    else:
        ok = owned == 0
    return passed("tree", detail) if ok else failed("tree", detail)


def _held(ledger: OwnershipLedger, held: _Held, num_in_flight: int) -> CheckResult:
    """Conservation, request by request: each row owns the pages its request holds, and the rows
    of no running request own nothing (counted: the sum over all rows matches)."""
    has_row = held.rows >= 0
    owned = ledger.row_pages[held.rows[has_row]]
    bad = np.flatnonzero(owned != held.pages[has_row])
    if len(bad):
        i = int(np.flatnonzero(has_row)[bad[0]])
        req = held.reqs[i]
        return failed("conservation", f"memory leak detected: request {req.rid} (row {req.req_pool_idx}) holds"
                                      f" {int(held.pages[i])} pages [{req.last_matched_prefix_len},"
                                      f" {req.kv_allocated_len}) but owns {int(owned[bad[0]])} in the ledger", str(req.rid))
    total = int(ledger.row_pages.sum())
    if total != int(owned.sum()):
        return failed("conservation", f"memory leak detected: request rows own {total} pages, running requests"
                                      f" hold {int(owned.sum())}")
    carried, expected = ledger.counts[CARRIED], int(held.pages[~has_row].sum())
    if carried != expected:
        return failed("conservation", f"memory leak detected: {carried} carried pages, but requests between chunks"
                                      f" hold {expected}")
    if ledger.counts[IN_FLIGHT] != num_in_flight:
        return failed("conservation", f"memory leak detected: the ledger has {ledger.counts[IN_FLIGHT]} pages of"
                                      f" decode slots in flight, the batches in flight hold {num_in_flight}")
    return passed("conservation", f"{len(held.reqs)} running requests own {total} pages (+ {carried} carried,"
                                  f" {num_in_flight} in flight)")


def _written_rows(ledger: OwnershipLedger, stack: Any, held: _Held) -> list[CheckResult]:
    """row_layout, slot_range, page_sharing over the row positions written this step."""
    entries = _gather(ledger, stack, held)
    if entries is None:
        return [passed(name, "no row written this step") for name in ("row_layout", "slot_range", "page_sharing")]
    rids, slots, spans = entries
    ps = ledger.page_size
    in_range = _range(ledger, rids, slots, spans)
    if not in_range.ok:  # the other two index pages by these slots
        return [passed("row_layout", "not checked: a slot is out of range"), in_range,
                passed("page_sharing", "not checked: a slot is out of range")]
    return [_layout(ps, rids, slots, spans), in_range, _sharing(ledger, rids, slots, spans)]


class _Spans:
    """The gathered positions as spans: span k is row `rows[k]` positions [starts[k],
    starts[k] + lens[k]), entries offsets[k].. of the gathered slots. Per-entry rows and
    positions are built only where a check needs them (paged layout, a failure)."""

    def __init__(self, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray, tree_len: np.ndarray):
        self.rows, self.starts, self.lens, self.tree_len = rows, starts, lens, tree_len
        self.offsets = np.cumsum(lens) - lens
        self.total = int(self.offsets[-1] + lens[-1])

    def span(self, i: int) -> int:
        return int(np.searchsorted(self.offsets, i, side="right")) - 1

    def pos_at(self, i: int) -> int:
        k = self.span(i)
        return int(self.starts[k] + i - self.offsets[k])

    def row_at(self, i: int) -> int:
        return int(self.rows[self.span(i)])

    def pos(self) -> np.ndarray:
        pos = np.arange(self.total, dtype=np.int64)
        pos -= np.repeat(self.offsets - self.starts, self.lens)
        return pos

    def first(self) -> np.ndarray:
        first = np.zeros(self.total, dtype=bool)
        first[self.offsets] = True
        return first

    def expected_owner(self) -> np.ndarray:
        """Per entry: TREE below the request's tree part, else its row (two runs per span)."""
        below = np.clip(self.tree_len - self.starts, 0, self.lens)
        values = np.empty(2 * len(self.rows), dtype=np.int64)
        values[0::2], values[1::2] = TREE, self.rows
        runs = np.empty(2 * len(self.rows), dtype=np.int64)
        runs[0::2], runs[1::2] = below, self.lens - below
        return np.repeat(values, runs)


def _gather(ledger: OwnershipLedger, stack: Any, held: _Held):
    """(rids, slots, spans) of the positions running requests had written this step, one span
    per row (vectorised); each span starts one position early, so a page continued this
    step is checked across its old and new slots."""
    dirty = ledger.dirty
    if not dirty:
        return None
    if len(dirty) == 1:  # one entry names each row once
        rows, starts, ends = dirty[0]
    else:
        rows = np.concatenate([d[0] for d in dirty])
        starts = np.concatenate([d[1] for d in dirty])
        ends = np.concatenate([d[2] for d in dirty])
        lo = np.full(ledger.num_rows, np.iinfo(np.int64).max)
        hi = np.zeros(ledger.num_rows, dtype=np.int64)
        np.minimum.at(lo, rows, starts)
        np.maximum.at(hi, rows, ends)
        touched = np.zeros(ledger.num_rows, dtype=bool)
        touched[rows] = True
        rows = np.flatnonzero(touched)
        starts, ends = lo[rows], hi[rows]
    index = np.full(ledger.num_rows, -1, dtype=np.int64)  # row -> running request
    with_rows = held.rows >= 0
    index[held.rows[with_rows]] = np.flatnonzero(with_rows)
    req = index[rows]
    live = req >= 0
    if not live.all():
        rows, starts, ends, req = rows[live], starts[live], ends[live], req[live]
    starts = np.maximum(starts - 1, 0)
    ends = np.minimum(ends, held.allocated[req])
    keep = ends > starts
    if not keep.all():
        rows, starts, ends, req = rows[keep], starts[keep], ends[keep], req[keep]
    if not len(rows):
        return None
    lens = ends - starts
    spans = _Spans(rows, starts, lens, held.tree_len[req])
    table = stack.req_to_token_pool.req_to_token
    if table.device.type == "cpu":
        host = table.numpy()
        if len(rows) <= 8:  # a few long spans (prefill): row slices
            parts = [host[r, a:b] for r, a, b in zip(rows.tolist(), starts.tolist(), ends.tolist())]
            slots = np.concatenate(parts) if len(parts) > 1 else parts[0]
        else:  # slots keep the table's dtype: compared and used as indices as is
            flat = np.repeat(rows * host.shape[1] + starts - spans.offsets, lens)
            flat += np.arange(spans.total, dtype=np.int64)
            slots = host.reshape(-1).take(flat)
    else:
        row_of = torch.from_numpy(np.repeat(rows, lens)).to(table.device)
        slots = table[row_of, torch.from_numpy(spans.pos()).to(table.device)].cpu().numpy()
    return _Rids(held.reqs, req), slots, spans


def _layout(ps: int, rids, slots, spans: _Spans) -> CheckResult:
    if ps == 1:
        return passed("row_layout", f"{len(slots)} written positions (page size 1)")
    pos, first = spans.pos(), spans.first()
    bad_offset = slots % ps != pos % ps
    bad_run = np.zeros(len(slots), dtype=bool)
    bad_run[1:] = ~first[1:] & (pos[1:] % ps != 0) & (slots[1:] != slots[:-1] + 1)
    bad = np.flatnonzero(bad_offset | bad_run)
    if not len(bad):
        return passed("row_layout", f"{len(slots)} written positions at offset t % {ps}")
    i = int(bad[0])
    rid = rids[spans.span(i)]
    t, slot = int(pos[i]), int(slots[i])
    if bad_offset[i]:
        return failed("row_layout", f"request {rid} position {t}: slot {slot} sits at offset {slot % ps} of page"
                                    f" {slot // ps}, expected offset {t % ps} (= {t} % {ps})", rid, (t,), (slot,))
    return failed("row_layout", f"request {rid} positions {t - 1} and {t} are on one page but hold slots"
                                f" {int(slots[i - 1])} and {slot}, expected {int(slots[i - 1]) + 1}", rid,
                  (t - 1, t), (int(slots[i - 1]), slot))


class _Rids:
    """The request id of each gathered span, looked up only when a check fails."""

    def __init__(self, reqs: list, index: np.ndarray):
        self.reqs, self.index = reqs, index

    def __getitem__(self, i: int) -> str:
        return str(self.reqs[int(self.index[i])].rid)


def _range(ledger: OwnershipLedger, rids, slots, spans: _Spans) -> CheckResult:
    ps = ledger.page_size
    if len(slots) and slots.min() >= ps and slots.max() < (ledger.num_pages + 1) * ps:
        return passed("slot_range", f"{len(slots)} written slots in [{ps}, {(ledger.num_pages + 1) * ps})")
    bad = np.flatnonzero((slots < ps) | (slots >= (ledger.num_pages + 1) * ps))
    if not len(bad):
        return passed("slot_range", f"{len(slots)} written slots in [{ps}, {(ledger.num_pages + 1) * ps})")
    i = int(bad[0])
    return failed("slot_range", f"written slot {int(slots[i])} (position {spans.pos_at(i)}) is outside"
                                f" [{ps}, {(ledger.num_pages + 1) * ps})", positions=(spans.pos_at(i),),
                  slots=(int(slots[i]),))


def _sharing(ledger: OwnershipLedger, rids, slots, spans: _Spans) -> CheckResult:
    pages = slots // ledger.page_size if ledger.page_size > 1 else slots
    found = ledger.owner.take(pages)
    expected = spans.expected_owner()
    bad = np.flatnonzero(found != expected)
    if not len(bad):
        return passed("page_sharing", f"{len(slots)} written positions owned by the tree or their request")
    i = int(bad[0])
    return failed("page_sharing", f"row {spans.row_at(i)} position {spans.pos_at(i)}: {ledger._what(int(pages[i]))}"
                                  f" is owned by {owner_name(int(found[i]))}, expected {owner_name(int(expected[i]))}",
                  positions=(spans.pos_at(i),), slots=(int(slots[i]),))
