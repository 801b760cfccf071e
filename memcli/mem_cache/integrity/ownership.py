"""Incremental integrity: who owns every page, kept up to date by the operations themselves.

An `OwnershipLedger` is attached to a stack only while checking (`track`); without one every
hook is a single `is not None` test. Each page (a slot when page_size == 1) has one owner:

    FREE     in the allocator's free list (or its pending release list)
    LOOSE    out of the allocator, owned by nobody: between an alloc and its claim, or between
             a release and the allocator's free. Never at the end of an operation sequence.
    TREE     a radix tree node
    CARRIED  a chunked request's partial page while it has no request row (between
             `free_req_rows` and its next extend, under deferred chunk caching)
    r >= 0   request row r (the request's own pages, [last_matched_prefix_len, kv_allocated_len))

Transitions, and who makes them:

    allocator alloc (any path)     FREE -> LOOSE           `take`
    alloc_for_extend / _decode     LOOSE|CARRIED|r -> r    `claim_rows`
      (fused: the allocator's      FREE|CARRIED|r -> r     `hand_out` + `claim_rows`, when the
       hand-out claimed at once)                           new pages are exactly those handed out)
    tree insert (cache_*_req)      r -> TREE               `move`
    cache frees, eviction          r|TREE -> LOOSE         `release`
    allocator free                 LOOSE -> FREE           `give_back`
    allocator free by an owner     r|TREE|IN_FLIGHT -> FREE  `free_from` (release + free in one)
    free_req_rows (hand-over)      r -> CARRIED            `carry_row`
    request row freed              (r must own nothing)    `rows_released`

The ledger is the allocator's `AllocationObserver` (`handed_out`, `taken_back`, `cleared`,
`snapshot`, `restore`) and the request table's `RowObserver` (`rows_released`); the owner codes
are those of `owners`. The trees and the allocation entry points call the rest.

A transition from an unexpected owner raises `IntegrityError` at once, naming the page, its
owner and the operation: a double free, a free of a page still in use, a page handed out
twice, a row released with pages it still owns (a lost page). What an operation cannot see
(a page allocated and never claimed, a row written out of layout) is checked at the end of
the step by `check_step`, in O(what the step changed + running requests).
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional

import numpy as np
import torch

from memcli.errors import IntegrityError
from memcli.mem_cache.integrity.history import MATCH, MAX_PAGES_SHOWN, PageHistory, Touch, page_label, story
from memcli.mem_cache.integrity.owners import CARRIED, FREE, IN_FLIGHT, LOOSE, OUTSIDE, PADDING, TREE, owner_name

MAX_DIRTY = 4096  # dirty row ranges kept per step before they are merged per row


class OwnershipError(IntegrityError):
    """An operation broke page ownership (or a step check failed): `step` and `check` say where,
    `history` the touches of the pages involved (oldest first, the refused operation last), and
    `story` the same as text, which `str()` adds below the one-line `message`."""

    def __init__(self, message: str, step: Optional[int] = None, check: Optional[str] = None,
                 history: tuple[Touch, ...] = (), story: str = ""):
        super().__init__(message)
        self.message, self.step, self.check = message, step, check
        self.history, self.story = history, story

    def __str__(self) -> str:
        return f"{self.message}\n{self.story}" if self.story else self.message


class LedgerState(NamedTuple):
    """A copy of the ledger (`snapshot` / `restore`), taken with the allocator's state."""

    owner: np.ndarray
    row_pages: np.ndarray
    row_len: np.ndarray
    counts: dict


def _host(values: Any) -> np.ndarray:
    """A 1-D int64 numpy copy of slot or page ids (tensor, list or array)."""
    if isinstance(values, torch.Tensor):
        if not values.is_cpu:
            values = values.cpu()
        values = values.numpy()  # slot ids never require grad
        if values.ndim != 1:
            values = values.reshape(-1)
        return values if values.dtype == np.int64 else values.astype(np.int64)  # read at once, never kept
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _page_runs(pages: np.ndarray) -> np.ndarray:
    """`pages` with each page repeated by its neighbour dropped: one entry per run of one page."""
    if len(pages) < 2:
        return pages
    repeat = np.empty(len(pages), dtype=bool)
    repeat[0] = False
    np.equal(pages[1:], pages[:-1], out=repeat[1:])
    return pages[~repeat]


class OwnershipLedger:
    """The owner of every page of one allocator, and the request rows each step touched."""

    def __init__(self, num_pages: int, page_size: int, num_rows: int, req_to_token: Optional[torch.Tensor] = None):
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_rows = num_rows
        self.req_to_token = req_to_token
        # Owners of pages 0..num_pages, and one guard entry (OUTSIDE) past the last page: a
        # clipped gather (`owners_of`) reads PADDING or OUTSIDE for any page outside the pool,
        # so comparing owners also tests the range.
        self._owners = np.empty(num_pages + 2, dtype=np.int32)
        self.owner = self._owners[: num_pages + 1]
        self.row_pages = np.zeros(num_rows, dtype=np.int64)  # pages each request row owns
        self.row_len = np.zeros(num_rows, dtype=np.int64)  # slots written in each row
        # Marks for duplicate detection, one per position of a call (`_set_if_distinct`): below
        # every owner and state; sliced, grown to the longest call.
        self._marks = np.arange(-8, -8 - 4096, -1, dtype=np.int32)
        self.dirty: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (rows, starts, ends) written
        self.step: Optional[int] = None  # the step running now (set by the checker), named in errors
        self._handed: Optional[np.ndarray] = None  # pages handed out, FREE until claimed (`hand_out`)
        self._host_table: Optional[tuple] = None  # (request table, its numpy view or None): `host_view`
        self.history = PageHistory(page_size)  # every transition, for the story of a failure
        self.row_rid = np.full(num_rows, -1, dtype=np.int64)  # the request of each row (history codes)
        self.acting: Optional[tuple[Optional[str], str]] = None  # (rid, why) while a request releases memory
        self.reset()

    def reset(self) -> None:
        """Every page free (page 0 padding), no row owns anything."""
        self._owners.fill(FREE)
        self._owners[0], self._owners[-1] = PADDING, OUTSIDE
        self.row_pages.fill(0)
        self.row_len.fill(0)
        self.counts = {FREE: self.num_pages, LOOSE: 0, TREE: 0, CARRIED: 0, IN_FLIGHT: 0}
        self.dirty = []
        self._handed = None

    def snapshot(self) -> LedgerState:
        self.settle()
        return LedgerState(self.owner.copy(), self.row_pages.copy(), self.row_len.copy(), dict(self.counts))

    def restore(self, state: LedgerState) -> None:
        self.owner[:] = state.owner
        self.row_pages[:] = state.row_pages
        self.row_len[:] = state.row_len
        self.counts = dict(state.counts)
        self.dirty = []
        self._handed = None

    # -- pages ------------------------------------------------------------------------------

    def page_ids(self, slots: np.ndarray) -> np.ndarray:
        """The page of each slot, as `memcli.mem_cache.pages.page_ids` gives it (which this
        package may not import: the caches import it): `slots // page_size`, an arithmetic
        shift for a power-of-two page."""
        ps = self.page_size
        if ps == 1:
            return slots
        return slots // ps if ps & (ps - 1) else slots >> (ps.bit_length() - 1)

    def pages_of(self, slots: Any) -> np.ndarray:
        """The distinct pages of `slots` (slot ids), ascending (page size 1: the slots as given)."""
        slots = _host(slots)
        if self.page_size == 1:
            return slots
        pages = self.page_ids(slots)
        if len(pages) > 2 * self.page_size:
            # A row's slots come in runs of one page: the neighbours' repeats dropped first, the
            # sort is over about one entry per page (the same answer as sorting them all).
            pages = _page_runs(pages)
        return np.unique(pages)

    def host_view(self, table: torch.Tensor) -> Optional[np.ndarray]:
        """A numpy view of `table` (the request table) when it lives on the CPU, else None;
        made once per table."""
        if self._host_table is None or self._host_table[0] is not table:
            self._host_table = (table, table.numpy() if table.device.type == "cpu" else None)
        return self._host_table[1]

    def owners_of(self, pages: np.ndarray) -> np.ndarray:
        """The owner of each page; PADDING (below 1) or OUTSIDE (past the last page) outside the
        pool, a state no transition starts from."""
        return self._owners.take(pages, mode="clip")

    def _check_range(self, pages: np.ndarray, op: str) -> None:
        if len(pages) and (pages.min() < 0 or pages.max() > self.num_pages):
            bad = int(pages[(pages < 0) | (pages > self.num_pages)][0])
            raise self.error("slot_range", f"{op}: page {bad} is outside the pool (valid pages 1..{self.num_pages})")

    def _set_if_distinct(self, pages: np.ndarray, value: Any, undo: Any) -> Optional[int]:
        """`owner[pages] = value` when no page occurs twice in `pages` (in range), and None; else
        `owner[pages] = undo` (what they held) and the index of the first page given twice.
        O(len), no sort: each position writes its own mark into the owner entries, and a page
        given twice reads back the mark of its later position (the same cache lines the
        transition touches, no scratch array)."""
        n = len(pages)
        if n <= 48 and len(set(pages.tolist())) == n:  # a set beats the marks' three passes here
            self.owner[pages] = value
            return None
        if n > self.num_pages + 1:  # more positions than pages: one is given twice
            _, first, times = np.unique(pages, return_index=True, return_counts=True)
            return int(first[times > 1].min())
        if n > len(self._marks):
            self._marks = np.arange(-8, -8 - max(n, 2 * len(self._marks)), -1, dtype=np.int32)
        marks = self._marks[:n]
        self.owner[pages] = marks
        twice = self.owner.take(pages) != marks
        if not np.count_nonzero(twice):
            self.owner[pages] = value
            return None
        self.owner[pages] = undo
        return int(twice.nonzero()[0][0])

    def _given_twice(self, pages: np.ndarray, i: int, op: str) -> "OwnershipError":
        page = int(pages[i])
        return self.error("double_free", f"{op}: {self.page_label(page)} given twice in one call", [page], op,
                          int(self.owner[page]) if 0 < page <= self.num_pages else None)

    def error(self, check: str, message: str, pages: Any = (), op: Optional[str] = None,
              found: Optional[int] = None) -> "OwnershipError":
        """The error of `check`; with `pages`, it tells their history, and `op` (refused on the
        first of them, then owned by `found`) closes it."""
        where = f"step {self.step}: " if self.step is not None else ""
        touches = self.history_of(pages)
        if op is not None and len(pages):
            rid = self.acting[0] if self.acting is not None else None
            first = int(pages[0])
            at = max((i + 1 for i, t in enumerate(touches) if t.page == first), default=0)
            touches.insert(at, self.history.refused(self.step, op, None, first, FREE if found is None else found,
                                                    rid, check))
        text = self.story_of(touches)
        return OwnershipError(f"{where}{check}: {message}", self.step, check, tuple(touches), text)

    def history_of(self, pages: Any) -> list[Touch]:
        """The touches of (at most `MAX_PAGES_SHOWN` of) `pages`, page after page, oldest first."""
        pages = [int(p) for p in list(pages)[:MAX_PAGES_SHOWN]]
        return self.history.of_pages(pages) if pages else []

    def story_of(self, touches: list[Touch]) -> str:
        return story(touches, self.history.since_step, self.page_label)

    # -- the history's view of requests -----------------------------------------------------

    def name_rows(self, rows: Any, rids: list) -> None:
        """Request rows `rows` belong to the requests `rids` (named in the history)."""
        code = self.history.code
        self.row_rid[np.asarray(rows, dtype=np.int64)] = [code(str(rid)) for rid in rids]

    def _rids(self, src: Any, dst: Any) -> Any:
        """The request codes of a transition: the row's request (of `dst`, else of `src`), else
        the request releasing memory now, else -1."""
        for owner in (dst, src):
            if isinstance(owner, np.ndarray):
                return self.row_rid.take(owner)
            if owner >= 0:
                return int(self.row_rid[owner])
        return self.history.code(self.acting[0]) if self.acting is not None else -1

    def _record(self, op: str, pages: Any, src: Any, dst: Any) -> None:
        why = self.acting[1] if self.acting is not None else None
        self.history.record(self.step, op, why, pages, src, dst, self._rids(src, dst))

    def page_label(self, page: int) -> str:
        return page_label(page, self.page_size)

    def _refused(self, pages: np.ndarray, found: np.ndarray, bad: np.ndarray, op: str, expected: Any,
                 distinct: bool) -> IntegrityError:
        """The error for a transition some of whose pages were not owned as `expected` (a state,
        or one row per page): the first of a page outside the pool, a page given twice (unless
        the caller knows the pages distinct), a page of another owner."""
        self._check_range(pages, op)
        if not distinct:
            twice = self._set_if_distinct(pages, found, found)
            if twice is not None:
                return self._given_twice(pages, twice, op)
        if isinstance(expected, np.ndarray):
            expected = f"request row {int(expected[np.flatnonzero(bad)[0]])}"
        return self._unexpected(pages, found, bad, op, expected)

    def _unexpected(self, pages: np.ndarray, found: np.ndarray, bad: np.ndarray, op: str, expected: str) -> IntegrityError:
        i = int(np.flatnonzero(bad)[0])
        page, owner = int(pages[i]), int(found[i])
        check = "double_free" if owner == FREE or op in ("allocator.free", "free_row_pages") else "owned_twice"
        return self.error(check, f"{check} in {op}: {self.page_label(page)} is owned by {owner_name(owner)}, expected"
                              f" {expected} ({int(bad.sum())} of {len(pages)} pages affected)", [page], op, owner)

    def _transition(self, pages: np.ndarray, src: int, dst: int, op: str, distinct: bool = False) -> None:
        """Pages owned by `src` (a state or a row) now belong to `dst`; raises, changing nothing,
        otherwise: a page outside the pool, a page given twice, a page of another owner.
        `distinct`: the caller knows no page occurs twice (skips that test)."""
        if self._handed is not None:
            self.settle()
        n = len(pages)
        if n == 1 and 0 < pages[0] <= self.num_pages and self.owner[pages[0]] == src:
            self.owner[pages[0]] = dst  # one page (a decode slot in flight, a small free): no array work
        elif not n:
            return
        else:
            self._transition_all(pages, src, dst, op, distinct)
        self._count(src, -n)
        self._count(dst, n)
        self._record(op, pages, src, dst)

    def _transition_all(self, pages: np.ndarray, src: int, dst: int, op: str, distinct: bool) -> None:
        found = self.owners_of(pages)  # one gather tests the range and the owner
        bad = found != src
        if np.count_nonzero(bad):
            raise self._refused(pages, found, bad, op, owner_name(src), distinct)
        if distinct:
            self.owner[pages] = dst
        else:
            twice = self._set_if_distinct(pages, dst, src)
            if twice is not None:
                raise self._given_twice(pages, twice, op)

    def _count(self, owner: int, n: int) -> None:
        if owner >= 0:
            self.row_pages[owner] += n
        else:
            self.counts[owner] += n

    # -- the allocator's and the request table's observer -------------------------------------

    def handed_out(self, pages: Any, claimed: bool) -> None:
        """`AllocationObserver`: the allocator handed out `pages`; `claimed`, the caller claims
        them at once (`hand_out`), else they are loose until claimed (`take`)."""
        if claimed:
            self.hand_out(pages)
        else:
            self.take(pages, "allocator.alloc")

    def taken_back(self, pages: Any, owner: Any, op: str, sorted_pages: bool = False) -> None:
        """`AllocationObserver`: the allocator took `pages` back from `owner` (None: pages already
        released, LOOSE), in one transition (`free_from`)."""
        self.free_from(pages, LOOSE if owner is None else owner, op, sorted_pages)

    def cleared(self) -> None:
        """`AllocationObserver`: every page is free again."""
        self.reset()

    # -- the transitions ---------------------------------------------------------------------

    def take(self, pages: Any, op: str = "alloc") -> None:
        """The allocator hands out `pages` (page ids): FREE -> LOOSE. The free list holds each FREE
        page once (every page entered it through `give_back`), so no range or duplicate test."""
        self._transition(_host(pages), FREE, LOOSE, op, distinct=True)

    def hand_out(self, pages: Any) -> None:
        """The allocator hands out `pages` to a caller that claims them at once (`claim_rows`,
        through `extended` / `decoded`): the FREE -> LOOSE step is folded into the claim. Until
        then the pages stay FREE here; anything else that reads the ledger first settles them."""
        if self._handed is not None:
            self.settle()
        self._handed = _host(pages).copy()  # the ring positions are rewritten by later frees

    def settle(self) -> None:
        """Pages handed out and not claimed (yet) become LOOSE, as an unfused `take` leaves them."""
        handed, self._handed = self._handed, None
        if handed is not None:
            self._transition(handed, FREE, LOOSE, "allocator.alloc", distinct=True)

    def free_from(self, pages: Any, owner: Any, op: str, sorted_pages: bool = False) -> None:
        """`owner` frees `pages` (page ids) straight into the allocator: owner -> FREE, i.e.
        `release` and `give_back` in one transition. `owner` is a state (LOOSE for a plain
        allocator free, TREE, IN_FLIGHT), a row, or one row per page (an array).
        `sorted_pages`: `pages` are sorted, so a page given twice sits beside itself (checked
        by comparing neighbours, not with the marks)."""
        pages = _host(pages)
        if sorted_pages and len(pages) > 1:
            twice = (pages[1:] == pages[:-1]).nonzero()[0]
            if len(twice):
                raise self._given_twice(pages, int(twice[0]), op)
        if isinstance(owner, np.ndarray):
            self._transition_each(pages, owner, FREE, op, sorted_pages)
        else:
            self._transition(pages, int(owner), FREE, op, sorted_pages)

    def give_back(self, pages: Any, op: str = "free") -> None:
        """The allocator puts `pages` (page ids) back: LOOSE -> FREE. A page still owned by a row or
        the tree was freed behind its owner's back; a FREE page is a double free."""
        self._transition(_host(pages), LOOSE, FREE, op)

    def release(self, slots: Any, owner: int, op: str) -> None:
        """`owner` (a row or TREE) gives up the pages of `slots` before freeing them: owner -> LOOSE."""
        self._transition_slots(slots, owner, LOOSE, op)

    def move(self, slots: Any, src: int, dst: int, op: str) -> None:
        """Ownership of the pages of `slots` passes from `src` to `dst` (a row's pages to the tree)."""
        self._transition_slots(slots, src, dst, op)

    def _transition_slots(self, slots: Any, src: int, dst: int, op: str) -> None:
        """`_transition` of the pages of `slots` (`pages_of`). Paged, a row's slots come in runs of
        one page: with the neighbours' repeats dropped and every page distinct and owned by
        `src`, the transition is made on them as they stand, without `pages_of`'s sort (the same
        pages, owners, counts and history). Anything else (a page seen twice, another owner)
        takes `pages_of` and `_transition` as they are, which judge it and raise as always."""
        if self.page_size == 1 or self._handed is not None:
            self._transition(self.pages_of(slots), src, dst, op)
            return
        pages = _page_runs(self.page_ids(_host(slots)))
        n = len(pages)
        if n < 2 or np.count_nonzero(self.owners_of(pages) != src) or self._set_if_distinct(pages, dst, src) is not None:
            self._transition(self.pages_of(slots), src, dst, op)  # nothing changed above: judged as always
            return
        self._count(src, -n)
        self._count(dst, n)
        self._record(op, pages, src, dst)

    def release_rows(self, page_starts: Any, rows: list[int], op: str) -> None:
        """Rows give up whole pages: `page_starts` holds one slot per page, `len(rows)` equal rows
        of them (a [len(rows), k] tensor, or [k] for one row), row i belonging to `rows[i]`."""
        slots = _host(page_starts)
        owners = np.repeat(np.asarray(rows, dtype=np.int64), len(slots) // max(len(rows), 1))
        self._transition_each(self.page_ids(slots), owners, LOOSE, op)

    def _transition_each(self, pages: np.ndarray, rows: np.ndarray, dst: int, op: str, distinct: bool = False) -> None:
        """Page `pages[i]` owned by row `rows[i]` passes to `dst` (a state)."""
        if self._handed is not None:
            self.settle()
        if not len(pages):
            return
        found = self.owners_of(pages)  # one gather tests the range and the owner
        bad = found != rows
        if np.count_nonzero(bad):
            raise self._refused(pages, found, bad, op, rows, distinct)
        if distinct:
            self.owner[pages] = dst
        else:
            twice = self._set_if_distinct(pages, dst, rows)
            if twice is not None:
                raise self._given_twice(pages, twice, op)
        self.row_pages -= np.bincount(rows, minlength=self.num_rows)
        self._count(dst, len(pages))
        self._record(op, pages, rows, dst)

    def claim_rows(self, slots: Any, rows: np.ndarray, op: str, lens: Optional[np.ndarray] = None) -> None:
        """Slot `slots[i]` was written into row `rows[i]`: its page is claimed by that row, from
        LOOSE (a new page) or CARRIED (a chunk's partial page), or is already the row's own (the
        row's partial last page). `slots` come request after request, in row order. With `lens`,
        `rows` has one entry per request, whose `lens[k]` slots come next.

        After `hand_out`, the new pages are FREE here: when they are exactly the pages handed
        out, in order, they pass FREE -> row in one step; otherwise the hand-out is settled
        (FREE -> LOOSE) first and the claim judged as without fusion."""
        handed, self._handed = self._handed, None
        slots = _host(slots)
        if not len(slots):
            if handed is not None:
                self._handed = handed
                self.settle()
            return
        pages = self.page_ids(slots)
        if handed is not None and len(pages) == len(handed) and not np.count_nonzero(pages != handed):
            # Every slot is a new page, exactly as handed out (one slot per page, distinct, in
            # range: the free list's): FREE -> row in one gather, one scatter.
            if not np.count_nonzero(self.owner.take(pages) != FREE):
                self._assign(pages, rows, lens)
                self.counts[FREE] -= len(pages)
                self._record(op, pages, FREE, rows if lens is None else rows.repeat(lens))
                return
        if lens is not None:
            rows = rows.repeat(lens)
        if self.page_size > 1:  # one entry per run of slots on one page
            first = np.ones(len(pages), dtype=bool)
            first[1:] = (pages[1:] != pages[:-1]) | (rows[1:] != rows[:-1])
            pages, rows = pages[first], rows[first]
        self._check_range(pages, op)  # distinct: new pages were checked by `take`, old ones are per row
        found = self.owner[pages]
        fresh_state = LOOSE
        if handed is not None:
            free = found == FREE
            if int(free.sum()) == len(handed) and np.array_equal(pages[free], handed):
                fresh_state = FREE  # exactly the pages handed out, each once: FREE -> row
            else:
                self._handed = handed
                self.settle()
                found = self.owner[pages]
        loose, carried = found == fresh_state, found == CARRIED
        bad = ~(loose | carried | (found == rows))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise self._unexpected(pages, found, bad, op, f"nobody (a new page) or request row {int(rows[i])}")
        new = loose | carried
        self.owner[pages[new]] = rows[new]
        self._record(op, pages[new], found[new], rows[new])
        self.counts[fresh_state] -= int(loose.sum())
        self.counts[CARRIED] -= int(carried.sum())
        self.row_pages += np.bincount(rows[new], minlength=self.num_rows)

    def _assign(self, pages: np.ndarray, rows: np.ndarray, lens: Optional[np.ndarray]) -> None:
        """Page `pages[i]` now belongs to row `rows[i]` (with `lens`: runs of `lens[k]` pages to
        `rows[k]`), whoever owned it; the rows' counts grow."""
        if lens is None:
            self.owner[pages] = rows
            self.row_pages += np.bincount(rows, minlength=self.num_rows)
        elif len(rows) <= 8:  # a few requests (a prefill batch): one slice each, no per-page row array
            start = 0
            for row, n in zip(rows.tolist(), lens.tolist()):
                self.owner[pages[start : start + n]] = row
                self.row_pages[row] += n
                start += n
        else:
            self.owner[pages] = rows.repeat(lens)
            np.add.at(self.row_pages, rows, lens)

    def wrote(self, row: int, start: int, end: int) -> None:
        """Row `row` positions [start, end) were written (checked at the end of the step)."""
        if end > start:
            span = np.array([[row], [start], [end]], dtype=np.int64)  # one array: rows, starts, ends are its rows
            self.dirty.append((span[0], span[1], span[2]))
            if end > self.row_len[row]:
                self.row_len[row] = end

    def wrote_rows(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.dirty.append((rows, starts, ends))
        np.maximum.at(self.row_len, rows, ends)

    def extended(self, rows: list[int], new_rows: list[int], prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                 prefix_tensors: list[torch.Tensor], out_cache_loc: torch.Tensor, rids: Optional[list] = None) -> None:
        """`alloc_for_extend` wrote rows: request i's new slots (`out_cache_loc`, request after
        request) are claimed by `rows[i]`; a new row also claims the carried pages of its prefix.
        `rids`: the requests of the rows (for the history; a new row's prefix is kept there as
        matched and locked)."""
        op = "alloc_for_extend"
        row_ids = np.asarray(rows, dtype=np.int64)
        if rids is not None:
            self.name_rows(row_ids, rids)
        prefix, seq = _host(prefix_lens).copy(), _host(seq_lens).copy()  # kept in `dirty`: own copies
        if not new_rows:
            fresh = np.zeros(len(rows), bool)
        elif len(new_rows) == len(rows):  # every row new (`_rows_for` takes a row for each missing one)
            fresh = np.ones(len(rows), bool)
        else:
            new = set(new_rows)
            fresh = np.fromiter((r in new for r in rows), bool, len(rows))
        if self.counts[CARRIED]:
            handed, self._handed = self._handed, None  # kept for the claim below
            for i in np.flatnonzero(fresh & (prefix > 0)):
                pages = self.pages_of(prefix_tensors[i])
                self._transition(pages[self.owner[pages] == CARRIED], CARRIED, int(row_ids[i]), op)
            self._handed = handed
        if rids is not None:
            for i in np.flatnonzero(fresh & (prefix > 0)).tolist():  # the tensor itself: O(1) here
                self.history.record(self.step, MATCH, None, prefix_tensors[i], TREE, TREE,
                                    int(self.row_rid[row_ids[i]]), slots=True)
        self.claim_rows(out_cache_loc, row_ids, op, lens=seq - prefix)
        # A new row's prefix was copied from the tree: its last page is checked with the new part
        # (the copy's alignment); the rest of it, O(prefix), is left to the full walks.
        starts = prefix
        if np.count_nonzero(fresh):
            starts = np.maximum(np.where(fresh, prefix - prefix % self.page_size - self.page_size, prefix), 0)
        self.wrote_rows(row_ids, starts, seq)

    def decoded(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
        """`alloc_for_decode` wrote one slot per row at column `seq_lens` (the old lengths)."""
        rows, seq = _host(req_pool_indices), _host(seq_lens)
        self.claim_rows(out_cache_loc, rows, "alloc_for_decode")
        self.wrote_rows(rows, seq, seq + 1)

    def carry_row(self, row: int, op: str = "free_req_rows") -> None:
        """A row is given back while its request lives on (a chunked request between pieces): the
        pages it owns go with the request (CARRIED) until its next extend claims them."""
        if not self.row_pages[row] or self.req_to_token is None:
            return
        slots = self.req_to_token[row, : int(self.row_len[row])]
        pages = self.pages_of(slots)
        own = pages[self.owner[pages] == row]
        self._transition(own, row, CARRIED, op)

    def rows_released(self, rows: Iterable[int], op: str = "free request row") -> None:
        """Request rows go back to the pool: each must own no page any more (else a page is lost)."""
        for row in rows:
            if self.row_pages[row]:
                pages = np.flatnonzero(self.owner == row)  # O(pool), only on the way to an error
                raise self.error("lost_page",
                    f"lost page in {op}: request row {row} is released but still owns {int(self.row_pages[row])}"
                    f" pages, e.g. {', '.join(self.page_label(int(p)) for p in pages[:3])}; they were never freed",
                    pages[:3], op, row)
            self.row_len[row] = 0

    # -- what the whole-stack walk sees ----------------------------------------------------------

    def seed(self, free_pages: np.ndarray, tree_slots: np.ndarray, own: list[tuple[int, np.ndarray]]) -> None:
        """Start from a stack in use: its free pages, tree slots, and (row, own slots) per request."""
        self.reset()
        self.owner[1:] = LOOSE
        self.counts[FREE] = 0
        self.counts[LOOSE] = self.num_pages
        self.give_back(free_pages, "seed")
        # The tree's slots and the rows' own pages start LOOSE, then are claimed.
        self._transition(self.pages_of(tree_slots), LOOSE, TREE, "seed")
        for row, slots in own:
            self._transition(self.pages_of(slots), LOOSE, row, "seed")
