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
                  (`integrity.host_tier`)
"""

from __future__ import annotations

from itertools import compress
from operator import attrgetter
from typing import Any, Iterable, NamedTuple, Optional

import numpy as np
import torch

from memcli.check_result import CheckResult, failed, passed
from memcli.mem_cache.integrity.host_tier import host_tier_step_check
from memcli.mem_cache.integrity.ownership import CARRIED, FREE, IN_FLIGHT, LOOSE, TREE, OwnershipLedger, owner_name
from memcli.mem_cache.integrity.requests import InFlightSlot

INCREMENTAL_NAMES = ("lost_page", "free_list", "tree", "conservation", "row_layout", "slot_range", "page_sharing")


def check_step(ledger: OwnershipLedger, stack: Any, running: Iterable[Any]) -> list[CheckResult]:
    """Every incremental check, in `INCREMENTAL_NAMES` order, passes with their numbers; clears
    the step's dirty rows."""
    return _run(ledger, stack, running, quiet=False)


def step_failure(ledger: OwnershipLedger, stack: Any, running: Iterable[Any]) -> Optional[CheckResult]:
    """The first check of `check_step` that fails (the same checks, in the same order), or None
    when all pass; the passes are not written up. Clears the step's dirty rows."""
    failures = _run(ledger, stack, running, quiet=True)
    return failures[0] if failures else None


def _run(ledger: OwnershipLedger, stack: Any, running: Iterable[Any], quiet: bool) -> list[CheckResult]:
    """The results in `INCREMENTAL_NAMES` order; `quiet`: the failures only. A check that passes
    may answer None when `quiet` (nothing to write up)."""
    ledger.settle()  # pages handed out and never claimed are LOOSE (lost) from here on
    held = _Held.of(running, ledger.page_size)
    results = [_lost_pages(ledger, quiet), _free_count(ledger, stack, quiet), _tree_count(ledger, stack, quiet),
               _held(ledger, held, quiet), *_written_rows(ledger, stack, held, quiet)]
    if stack.tree_cache.host_tier() is not None:
        results.append(host_tier_step_check(stack.tree_cache))
    ledger.dirty = []
    if quiet:
        return [result for result in results if result is not None and not result.ok]
    return results


_ROW, _ALLOCATED = attrgetter("req_pool_idx"), attrgetter("kv_allocated_len")
_TREE_LEN = attrgetter("last_matched_prefix_len")
_KV, _FREED = attrgetter("kv"), attrgetter("kv_freed")


def _rows_of(records: list) -> tuple[np.ndarray, bool]:
    """The request rows of `records` (requests or their memory records), and whether every
    one has a row (-1 where none: a chunked request between chunks)."""
    try:
        return np.fromiter(map(_ROW, records), np.int64, len(records)), True
    except TypeError:  # a row is None
        return np.array([-1 if r.req_pool_idx is None else r.req_pool_idx for r in records], dtype=np.int64), False


class _Held(NamedTuple):
    """The running requests as arrays: row (-1 without one), allocated and tree lengths, pages held."""

    reqs: list
    rows: np.ndarray
    allocated: np.ndarray
    tree_len: np.ndarray
    pages: np.ndarray
    all_rows: bool  # every request holds a row (no chunked request between chunks)
    num_in_flight: int  # decode slots in flight (overlap), held by no request

    @classmethod
    def of(cls, running: Iterable[Any], page_size: int) -> "_Held":
        running = running if isinstance(running, list) else list(running)
        if len(running) <= 32:  # a few requests: the filter below costs less than the passes it saves
            return cls._of_holders(running, page_size)
        try:
            # Plain requests: their memory records (`req.kv`, which the request's own names
            # mirror) read in C, one pass per field, no per-request filter.
            kvs = list(map(_KV, running))
        except AttributeError:  # an in-flight slot (it has no memory record) among them
            return cls._of_holders(running, page_size)
        reqs = running
        freed = np.fromiter(map(_FREED, kvs), bool, len(kvs))
        if np.count_nonzero(freed):
            keep = ~freed
            reqs, kvs = list(compress(running, keep)), list(compress(kvs, keep))
        return cls._with_lengths(reqs, kvs, *_rows_of(kvs), 0, page_size)

    @classmethod
    def _of_holders(cls, running: list, page_size: int) -> "_Held":
        """`of` where some holders are in-flight slots: requests first filtered one by one."""
        reqs = [r for r in running if not r.kv_freed and r.__class__ is not InFlightSlot]
        num_flying = sum(1 for r in running if isinstance(r, InFlightSlot)) if len(reqs) < len(running) else 0
        return cls._with_lengths(reqs, reqs, *_rows_of(reqs), num_flying, page_size)

    @classmethod
    def _with_lengths(cls, reqs: list, records: list, rows: np.ndarray, all_rows: bool, num_flying: int,
                      page_size: int) -> "_Held":
        """The `_Held` of `reqs`, whose lengths are read from `records` (the same objects or
        their memory records)."""
        n = len(records)
        allocated = np.fromiter(map(_ALLOCATED, records), np.int64, n)
        tree_len = np.fromiter(map(_TREE_LEN, records), np.int64, n)
        pages = allocated - tree_len if page_size == 1 else -(-allocated // page_size) - tree_len // page_size
        return cls(reqs, rows, allocated, tree_len, pages, all_rows, num_flying)

    def index_of(self, rows: np.ndarray, num_rows: int) -> np.ndarray:
        """The running request holding each of `rows` (its index here), -1 for none."""
        index = np.full(num_rows, -1, dtype=np.int64)
        if self.all_rows:
            index[self.rows] = np.arange(len(self.rows))
        else:
            with_rows = self.rows >= 0
            index[self.rows[with_rows]] = with_rows.nonzero()[0]
        return index.take(rows)


def _lost_pages(ledger: OwnershipLedger, quiet: bool) -> Optional[CheckResult]:
    loose = ledger.counts[LOOSE]
    if not loose:
        return None if quiet else passed("lost_page", "every page out of the allocator has an owner")
    pages = np.flatnonzero(ledger.owner == LOOSE)  # O(pool), only on the way to a failure
    what = ", ".join(ledger.page_label(int(p)) for p in pages[:3])
    return failed("lost_page", f"memory leak detected: {loose} pages are out of the allocator but owned by nobody"
                               f" (allocated and never claimed, or released and never freed), e.g. {what}",
                  slots=tuple(int(p) for p in pages[:8]))


def _free_count(ledger: OwnershipLedger, stack: Any, quiet: bool) -> Optional[CheckResult]:
    alloc = stack.allocator
    free, avail = ledger.counts[FREE], alloc.available_size() // alloc.page_size
    if free == avail and quiet:
        return None
    detail = f"ledger {free} free pages, allocator {avail}"
    return passed("free_list", detail) if free == avail else failed("free_list", detail + " (a duplicate or a lost free)")


def _tree_count(ledger: OwnershipLedger, stack: Any, quiet: bool) -> Optional[CheckResult]:
    tree, ps = stack.tree_cache, ledger.page_size
    total, evictable, protected = tree.total_size(), tree.evictable_size(), tree.tree_protected_size()
    owned = ledger.counts[TREE] * ps
    if hasattr(tree, "all_values_flatten"):
        ok = owned == total and evictable + protected == total
    else:
        ok = owned == 0
    if ok and quiet:
        return None
    detail = f"ledger {owned} tree tokens, tree total {total} (evictable {evictable} + protected {protected})"
    return passed("tree", detail) if ok else failed("tree", detail)


def _held(ledger: OwnershipLedger, held: _Held, quiet: bool) -> Optional[CheckResult]:
    """Conservation, request by request: each row owns the pages its request holds, and the rows
    of no running request own nothing (counted: the sum over all rows matches)."""
    if held.all_rows:
        rows, pages, carried_held = held.rows, held.pages, 0
    else:
        has_row = held.rows >= 0
        rows, pages, carried_held = held.rows[has_row], held.pages[has_row], int(held.pages[~has_row].sum())
    owned = ledger.row_pages.take(rows)
    bad = (owned != pages).nonzero()[0]
    if len(bad):
        i = int(bad[0]) if held.all_rows else int(np.flatnonzero(held.rows >= 0)[bad[0]])
        req = held.reqs[i]
        return failed("conservation", f"memory leak detected: request {req.rid} (row {req.req_pool_idx}) holds"
                                      f" {int(held.pages[i])} pages [{req.last_matched_prefix_len},"
                                      f" {req.kv_allocated_len}) but owns {int(owned[bad[0]])} in the ledger", str(req.rid))
    add = np.add.reduce  # the ufunc itself: `ndarray.sum`'s wrapper costs more than these sums
    total, owned_total = int(add(ledger.row_pages)), int(add(owned))
    if total != owned_total:
        return failed("conservation", f"memory leak detected: request rows own {total} pages, running requests"
                                      f" hold {owned_total}")
    carried = ledger.counts[CARRIED]
    if carried != carried_held:
        return failed("conservation", f"memory leak detected: {carried} carried pages, but requests between chunks"
                                      f" hold {carried_held}")
    if ledger.counts[IN_FLIGHT] != held.num_in_flight:
        return failed("conservation", f"memory leak detected: the ledger has {ledger.counts[IN_FLIGHT]} pages of"
                                      f" decode slots in flight, the batches in flight hold {held.num_in_flight}")
    if quiet:
        return None
    return passed("conservation", f"{len(held.reqs)} running requests own {total} pages (+ {carried} carried,"
                                  f" {held.num_in_flight} in flight)")


def _written_rows(ledger: OwnershipLedger, stack: Any, held: _Held, quiet: bool) -> list[Optional[CheckResult]]:
    """row_layout, slot_range, page_sharing over the row positions written this step.

    One clipped gather of the slots' owners (`OwnershipLedger.owners_of`) serves two checks: a
    slot outside the pool reads PADDING or OUTSIDE, never the tree or a row, so when every
    owner is as expected the range holds too; otherwise the range is tested first, as the
    other two index pages by these slots."""
    entries = _gather(ledger, stack, held)
    if entries is None:
        if quiet:
            return [None, None, None]
        return [passed(name, "no row written this step") for name in ("row_layout", "slot_range", "page_sharing")]
    rids, slots, spans = entries
    ps = ledger.page_size
    pages = ledger.page_ids(slots)
    found = ledger.owners_of(pages)
    i = spans.first_unexpected(found)
    layout = _layout(ps, rids, slots, spans, quiet)
    if i < 0:
        if quiet:
            return [layout, None, None]
        return [layout, passed("slot_range", _range_detail(ledger, slots)),
                passed("page_sharing", f"{len(slots)} written positions owned by the tree or their request")]
    in_range = _range(ledger, slots, spans, rids)
    if not in_range.ok:
        return [passed("row_layout", "not checked: a slot is out of range"), in_range,
                passed("page_sharing", "not checked: a slot is out of range")]
    sharing = failed("page_sharing", f"row {spans.row_at(i)} position {spans.pos_at(i)}: {ledger.page_label(int(pages[i]))}"
                                     f" is owned by {owner_name(int(found[i]))}, expected"
                                     f" {owner_name(spans.expected_at(i))}",
                     rids[spans.span(i)], positions=(spans.pos_at(i),), slots=(int(slots[i]),))
    return [layout, in_range, sharing]


class _Spans:
    """The gathered positions as spans: span k is row `rows[k]` positions [starts[k],
    starts[k] + lens[k]), entries offsets[k].. of the gathered slots. Per-entry rows and
    positions are built only where a check needs them (paged layout, a failure)."""

    def __init__(self, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray, tree_len: np.ndarray):
        self.rows, self.starts, self.lens, self.tree_len = rows, starts, lens, tree_len
        ends = lens.cumsum()
        self.offsets = ends - lens
        self.total = int(ends[-1])

    def span(self, i: int) -> int:
        return int(np.searchsorted(self.offsets, i, side="right")) - 1

    def pos_at(self, i: int) -> int:
        k = self.span(i)
        return int(self.starts[k] + i - self.offsets[k])

    def row_at(self, i: int) -> int:
        return int(self.rows[self.span(i)])

    def pos(self) -> np.ndarray:
        pos = np.arange(self.total, dtype=np.int64)
        pos -= (self.offsets - self.starts).repeat(self.lens)
        return pos

    def expected_at(self, i: int) -> int:
        """The owner entry `i` must have (`expected_owner`'s entry `i`)."""
        k = self.span(i)
        return TREE if self.starts[k] + i - self.offsets[k] < self.tree_len[k] else int(self.rows[k])

    def first_unexpected(self, found: np.ndarray) -> int:
        """The first entry whose owner in `found` is not `expected_owner()`'s, or -1. A few
        spans (a prefill) are compared run by run with their owner, building no per-entry
        array; many (a decode step) at once."""
        if len(self.rows) > 8 or self.total < 512 * len(self.rows):  # short spans: one vector compare is cheaper
            wrong = (found != self.expected_owner()).nonzero()[0]
            return int(wrong[0]) if len(wrong) else -1
        spans = zip(self.rows.tolist(), self.starts.tolist(), self.lens.tolist(), self.tree_len.tolist(),
                    self.offsets.tolist())
        for row, start, n, tree_len, offset in spans:
            below = min(max(tree_len - start, 0), n)
            for owner, lo, hi in ((TREE, offset, offset + below), (row, offset + below, offset + n)):
                if hi > lo:
                    wrong = (found[lo:hi] != owner).nonzero()[0]
                    if len(wrong):
                        return lo + int(wrong[0])
        return -1

    def expected_owner(self) -> np.ndarray:
        """Per entry: TREE below the request's tree part, else its row (two runs per span)."""
        if not np.count_nonzero(self.tree_len > self.starts):
            return self.rows.repeat(self.lens)
        below = np.maximum(np.minimum(self.tree_len - self.starts, self.lens), 0)
        values = np.empty(2 * len(self.rows), dtype=np.int64)
        values[0::2], values[1::2] = TREE, self.rows
        runs = np.empty(2 * len(self.rows), dtype=np.int64)
        runs[0::2], runs[1::2] = below, self.lens - below
        return values.repeat(runs)


def _gather(ledger: OwnershipLedger, stack: Any, held: _Held):
    """(rids, slots, spans) of the positions running requests had written this step, one span
    per row (vectorised); each span starts one position early, so a page continued this
    step is checked across its old and new slots."""
    dirty = ledger.dirty
    if not dirty:
        return None
    rows, starts, ends = dirty[0] if len(dirty) == 1 else _merged(ledger, dirty)  # one entry names each row once
    if len(rows) == len(held.rows) and not np.count_nonzero(rows != held.rows):  # every running request's row, in order
        req, allocated, tree_len = None, held.allocated, held.tree_len
    else:
        req = held.index_of(rows, ledger.num_rows)
        live = req >= 0
        if np.count_nonzero(live) < len(live):
            rows, starts, ends, req = rows[live], starts[live], ends[live], req[live]
        allocated, tree_len = held.allocated[req], held.tree_len[req]
    starts = np.maximum(starts - 1, 0)
    ends = np.minimum(ends, allocated)
    keep = ends > starts
    if np.count_nonzero(keep) < len(keep):
        req = keep.nonzero()[0] if req is None else req[keep]
        rows, starts, ends, tree_len = rows[keep], starts[keep], ends[keep], tree_len[keep]
    if not len(rows):
        return None
    lens = ends - starts
    spans = _Spans(rows, starts, lens, tree_len)
    table = stack.req_to_token_pool.req_to_token
    host = ledger.host_view(table)
    if host is not None:
        if len(rows) <= 8:  # a few long spans (prefill): row slices
            parts = [host[r, a:b] for r, a, b in zip(rows.tolist(), starts.tolist(), ends.tolist())]
            slots = np.concatenate(parts) if len(parts) > 1 else parts[0]
        else:  # slots keep the table's dtype: compared and used as indices as is
            flat = (rows * host.shape[1] + starts - spans.offsets).repeat(lens)
            flat += np.arange(spans.total, dtype=np.int64)
            slots = host.reshape(-1).take(flat)
    else:
        row_of = torch.from_numpy(np.repeat(rows, lens)).to(table.device)
        slots = table[row_of, torch.from_numpy(spans.pos()).to(table.device)].cpu().numpy()
    return _Rids(held.reqs, req), slots, spans


def _merged(ledger: OwnershipLedger, dirty: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's dirty entries as one span per row (rows ascending): the lowest start and the
    highest end written."""
    if sum(len(entry[0]) for entry in dirty) <= 32:  # a few rows (a prefill step): a dict beats the scatters
        bounds: dict[int, tuple[int, int]] = {}
        for entry in dirty:
            for row, start, end in zip(*(part.tolist() for part in entry)):
                seen = bounds.get(row)
                bounds[row] = (start, end) if seen is None else (min(seen[0], start), max(seen[1], end))
        rows = sorted(bounds)
        return (np.array(rows, dtype=np.int64), np.array([bounds[r][0] for r in rows], dtype=np.int64),
                np.array([bounds[r][1] for r in rows], dtype=np.int64))
    rows = np.concatenate([d[0] for d in dirty])
    starts = np.concatenate([d[1] for d in dirty])
    ends = np.concatenate([d[2] for d in dirty])
    lo = np.full(ledger.num_rows, np.iinfo(np.int64).max)
    hi = np.zeros(ledger.num_rows, dtype=np.int64)
    np.minimum.at(lo, rows, starts)
    np.maximum.at(hi, rows, ends)
    touched = np.zeros(ledger.num_rows, dtype=bool)
    touched[rows] = True
    rows = touched.nonzero()[0]
    return rows, lo[rows], hi[rows]


def _layout(ps: int, rids, slots, spans: _Spans, quiet: bool) -> Optional[CheckResult]:
    """A written position sits at its offset in its page (`slot % ps == t % ps`), and one that
    continues a page (not a page's first position, not a span's first) holds the slot after
    the position before it; the first position where either fails is reported.

    The offsets are read only where a run of one page begins (a span's first position, a
    page's first position): a position that continues a page with the slot after its
    neighbour's has a wrong offset only if that neighbour has, so the first failure of the
    definition is a run that breaks or a run that begins at a wrong offset, and these are
    the positions compared."""
    if ps == 1:
        return None if quiet else passed("row_layout", f"{len(slots)} written positions (page size 1)")
    starts, lens, offsets = spans.starts, spans.lens, spans.offsets
    first = -(-starts // ps) * ps  # each span's first page start at or after its first position
    counts = np.maximum(-(-(starts + lens - first) // ps), 0)  # the page starts inside each span
    page_starts = np.repeat(offsets + first - starts - ps * (counts.cumsum() - counts), counts)
    page_starts += ps * np.arange(len(page_starts), dtype=np.int64)  # their entries
    broken = slots[1:] != slots[:-1] + 1  # entry i + 1 does not hold the slot after entry i's
    broken[page_starts[page_starts > 0] - 1] = False  # a page's first position continues nothing
    broken[offsets[1:] - 1] = False  # nor does a span's first position
    candidates = []
    if len(broken) and broken[j := int(broken.argmax())]:
        candidates.append(j + 1)
    off_page = slots[page_starts] % ps != 0
    if len(off_page) and off_page[j := int(off_page.argmax())]:
        candidates.append(int(page_starts[j]))
    off_span = slots[offsets] % ps != starts % ps
    if off_span[j := int(off_span.argmax())]:
        candidates.append(int(offsets[j]))
    if not candidates:
        return None if quiet else passed("row_layout", f"{len(slots)} written positions at offset t % {ps}")
    i = min(candidates)
    rid = rids[spans.span(i)]
    t, slot = spans.pos_at(i), int(slots[i])
    if slot % ps != t % ps:
        return failed("row_layout", f"request {rid} position {t}: slot {slot} sits at offset {slot % ps} of page"
                                    f" {slot // ps}, expected offset {t % ps} (= {t} % {ps})", rid, (t,), (slot,))
    return failed("row_layout", f"request {rid} positions {t - 1} and {t} are on one page but hold slots"
                                f" {int(slots[i - 1])} and {slot}, expected {int(slots[i - 1]) + 1}", rid,
                  (t - 1, t), (int(slots[i - 1]), slot))


class _Rids:
    """The request id of each gathered span, looked up only when a check fails. `index` None:
    span k is request k."""

    def __init__(self, reqs: list, index: Optional[np.ndarray]):
        self.reqs, self.index = reqs, index

    def __getitem__(self, i: int) -> str:
        return str(self.reqs[i if self.index is None else int(self.index[i])].rid)


def _range_detail(ledger: OwnershipLedger, slots: np.ndarray) -> str:
    ps = ledger.page_size
    return f"{len(slots)} written slots in [{ps}, {(ledger.num_pages + 1) * ps})"


def _range(ledger: OwnershipLedger, slots: np.ndarray, spans: _Spans, rids: "_Rids") -> CheckResult:
    ps = ledger.page_size
    bad = np.flatnonzero((slots < ps) | (slots >= (ledger.num_pages + 1) * ps))
    if not len(bad):
        return passed("slot_range", _range_detail(ledger, slots))
    i = int(bad[0])
    return failed("slot_range", f"written slot {int(slots[i])} (position {spans.pos_at(i)}) is outside"
                                f" [{ps}, {(ledger.num_pages + 1) * ps})", rids[spans.span(i)],
                  positions=(spans.pos_at(i),), slots=(int(slots[i]),))
