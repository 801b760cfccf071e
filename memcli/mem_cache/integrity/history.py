"""The history of pages: every ownership transition the ledger made, kept while checking, so
that an integrity failure tells the story of the pages it names (who allocated them, when the
tree took them, who freed them) instead of one number.

The ledger (`ownership.OwnershipLedger`) records each transition as it makes it (`record`): the
step, the operation (`op`, the code's name: `alloc_for_extend`, `cache_finished_req`, `evict`,
...), why a request gave memory back (`finished`, `retracted`, `aborted`), the pages, the owner
before and after, and the request of the row involved. A failing operation is recorded too,
as refused. `of_pages` answers the touches of some pages, oldest first, as `Touch` values.

Cost: one append of a copy of the pages per transition, only while a ledger is attached
(`replay --check`); nothing otherwise. Memory is bounded: past `MAX_PAGES_KEPT` page entries
the oldest transitions are dropped (`since_step` says from when the history is complete).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, NamedTuple, Optional, Union

import numpy as np

from memcli.mem_cache.integrity.owners import CARRIED, FREE, IN_FLIGHT, LOOSE, TREE, owner_name

MAX_PAGES_KEPT = 4_000_000  # page entries kept, oldest dropped first (~100 MB at most)
MAX_TOUCHES_SHOWN = 12  # per page, the latest ones, in an error's story
MAX_PAGES_SHOWN = 4  # pages whose story an error tells
REFUSED = "refused"  # a touch's `dst` for the operation that failed
MATCH = "match_prefix"  # the operation of a prefix matched and locked at admission

Owners = Union[int, np.ndarray]  # one owner code for every page, or one per page


class Touch(NamedTuple):
    """One operation on one page, as a failure's story tells it."""

    step: Optional[int]  # the step the operation belongs to (None: before the first step)
    rid: Optional[str]  # the request whose row (or release) it was, when one was
    op: str  # the operation's name in the code
    what: str  # what it did, in words
    page: int
    src: str  # owner before (`owner_name`)
    dst: str  # owner after; REFUSED for the operation that failed (`what` is then the check)

    def to_dict(self) -> dict:
        return {"step": self.step, "rid": self.rid, "op": self.op, "what": self.what, "page": self.page,
                "from": self.src, "to": self.dst}

    @property
    def refused(self) -> bool:
        return self.dst == REFUSED

    def line(self) -> str:
        step = "-" if self.step is None else str(self.step)
        rid = "" if self.rid is None else f"request {self.rid}: "
        if self.refused:
            return f"step {step:>5}  {rid}{self.op} REFUSED ({self.what}): the page is owned by {self.src}"
        if self.src == self.dst:
            return f"step {step:>5}  {rid}{self.what} ({self.op}), owned by {self.src}"
        return f"step {step:>5}  {rid}{self.what} ({self.op}): {self.src} -> {self.dst}"


class _Entry(NamedTuple):
    step: Optional[int]
    op: str
    why: Optional[str]
    pages: Any  # int64 numpy array, or a tensor of slots (`slots`: True)
    src: Owners
    dst: Owners
    rids: Union[int, np.ndarray]  # rid codes (-1: none), one or one per page
    slots: bool  # `pages` holds slots (a matched prefix, kept as the tensor it was)


def _collapsed(touches: list[Touch]) -> list[Touch]:
    """Runs of matches of one page (a hot prefix is matched by many requests) as one touch:
    the first match's step, the requests that matched, in order."""
    out: list[Touch] = []
    run: list[Touch] = []
    for touch in [*touches, None]:
        if touch is not None and touch.op == MATCH:
            run.append(touch)
            continue
        if len(run) == 1:
            out.append(run[0])
        elif run:
            rids = list(dict.fromkeys(t.rid for t in run if t.rid is not None))
            shown = ", ".join(rids[:4]) + (f" (+{len(rids) - 4})" if len(rids) > 4 else "")
            out.append(run[0]._replace(rid=shown or None, what=f"matched as a prefix and locked {len(run)} times"
                                       f" (steps {run[0].step}..{run[-1].step})"))
        run = []
        if touch is not None:
            out.append(touch)
    return out


def describe(op: str, why: Optional[str], src: int, dst: int) -> str:
    """What an operation did to a page, in words."""
    if dst == src:
        return "matched as a prefix and locked"
    if op == "alloc_for_extend":
        return "allocated for an extend" if src in (FREE, LOOSE) else "claimed by its row for an extend"
    if op == "alloc_for_decode":
        return "allocated for a decode"
    if dst == TREE:
        return {"load_back": "loaded back from the host tier into the tree"}.get(op, "inserted into the tree")
    if src == TREE and op.startswith("evict"):
        return "evicted from the tree" + (" (backed up on the host)" if "backed" in op else "")
    if dst == CARRIED:
        return "carried by its chunked request (row given back)"
    if dst == IN_FLIGHT:
        return "kept by the decode batch in flight"
    if dst == LOOSE and src == FREE:
        return "handed out by the allocator"
    if op == "seed":
        return "in use when checking began"
    if dst in (FREE, LOOSE):
        return _freed(op, why, src)
    return op


def _freed(op: str, why: Optional[str], src: int) -> str:
    if why == "retracted":
        return "freed by a retraction"
    if why == "aborted":
        return "freed by an abort"
    if why == "finished" or op == "cache_finished_req":
        return "freed at finish"
    if op == "cache_unfinished_req":
        return "freed (a duplicate of the tree's copy)"
    if src == IN_FLIGHT:
        return "freed after the batch in flight"
    return "freed"


class PageHistory:
    """The transitions of one ledger, oldest first, bounded by `MAX_PAGES_KEPT` page entries."""

    def __init__(self, page_size: int, max_pages: int = MAX_PAGES_KEPT):
        self.page_size = page_size
        self.max_pages = max_pages
        self._entries: deque[_Entry] = deque()
        self._kept = 0  # page entries in `_entries`
        self.since_step: Optional[int] = None  # None: complete; else complete from this step on
        self._rids: list[str] = []
        self._codes: dict[str, int] = {}

    def code(self, rid: Optional[str]) -> int:
        """The code of a request id (-1 for None), for `record`'s `rids`."""
        if rid is None:
            return -1
        code = self._codes.get(rid)
        if code is None:
            code = self._codes[rid] = len(self._rids)
            self._rids.append(rid)
        return code

    def record(self, step: Optional[int], op: str, why: Optional[str], pages: Any, src: Owners, dst: Owners,
               rids: Union[int, np.ndarray], slots: bool = False) -> None:
        """Keep one transition. `pages` is copied unless `slots` (a tensor nobody rewrites)."""
        if not slots:
            if isinstance(pages, np.ndarray) and pages.dtype == np.int64 and pages.ndim == 1:
                pages = pages.copy()  # the ledger's own arrays: one copy, no conversion
            else:
                pages = np.array(pages, dtype=np.int64, copy=True).reshape(-1)
        n = len(pages)
        if not n:
            return
        self._entries.append(_Entry(step, op, why, pages, src, dst, rids, slots))
        self._kept += n
        while self._kept > self.max_pages and len(self._entries) > 1:
            dropped = self._entries.popleft()
            self._kept -= len(dropped.pages)
            self.since_step = self._entries[0].step

    def of_pages(self, pages: Any, limit: int = MAX_TOUCHES_SHOWN) -> list[Touch]:
        """The touches of `pages` (page ids), oldest first: at most the last `limit` of each page."""
        per_page: dict[int, list[Touch]] = {int(p): [] for p in np.asarray(pages, dtype=np.int64).reshape(-1)}
        wanted = np.fromiter(per_page, dtype=np.int64, count=len(per_page))
        for entry in self._entries:
            ids = self._page_ids(entry)
            seen = set()  # a prefix names a page once per slot: one touch per entry
            for i in np.flatnonzero(np.isin(ids, wanted)).tolist():
                page = int(ids[i])
                if page not in seen:
                    seen.add(page)
                    per_page[page].append(self._touch(entry, i, page))
        return [t for page in per_page.values() for t in _collapsed(page)[-limit:]]  # page after page, as asked

    def _page_ids(self, entry: _Entry) -> np.ndarray:
        if not entry.slots:
            return entry.pages
        slots = entry.pages.cpu().numpy().astype(np.int64) if hasattr(entry.pages, "cpu") else np.asarray(entry.pages)
        return slots // self.page_size if self.page_size > 1 else slots

    def _touch(self, entry: _Entry, i: int, page: int) -> Touch:
        src = int(entry.src if np.isscalar(entry.src) else entry.src[i])
        dst = int(entry.dst if np.isscalar(entry.dst) else entry.dst[i])
        code = int(entry.rids if np.isscalar(entry.rids) else entry.rids[i])
        rid = self._rids[code] if code >= 0 else None
        return Touch(entry.step, rid, entry.op, describe(entry.op, entry.why, src, dst), page, owner_name(src),
                     owner_name(dst))

    def refused(self, step: Optional[int], op: str, why: Optional[str], page: int, src: int, rid: Optional[str],
                check: str) -> Touch:
        """The touch of the operation that failed (not kept: it changed nothing)."""
        return Touch(step, rid, op, check.replace("_", " "), page, owner_name(src), REFUSED)


def page_label(page: int, page_size: int) -> str:
    """`slot 7`, or `page 3 (slots 48..63)`."""
    if page_size == 1:
        return f"slot {page}"
    return f"page {page} (slots {page * page_size}..{page * page_size + page_size - 1})"


def story(touches: list[Touch], since_step: Optional[int] = None, label: Callable[[int], str] = str) -> str:
    """The touches as text, one page after another (what an error prints); `label` names a page."""
    lines, page = [], None
    for touch in touches:
        if touch.page != page:
            page = touch.page
            kept = "" if since_step is None else f" (kept since step {since_step})"
            lines.append(f"history of {label(page)}{kept}:")
        lines.append(f"  {touch.line()}")
    return "\n".join(lines)
