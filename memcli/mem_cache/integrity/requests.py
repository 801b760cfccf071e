"""What running requests hold: their `req_to_token` rows and their share of the pool.

A request row, in positions (tree_len = last_matched_prefix_len, page aligned):

    [0, tree_len)                  slots of tree pages (shared through the tree, locked)
    [tree_len, kv_allocated_len)   the request's own pages, the last one possibly partial

Under overlap scheduling one more kind of holder exists: an `InFlightSlot`, the decode slot
of a request that finished or was retracted while the batch that allocated it was in flight.
No row holds it any more (the request gave its row back), yet it is not free until that
batch's result is processed. The checks count it as one page held on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable

import numpy as np
import torch

from memcli.check_result import CheckResult


@dataclass(frozen=True)
class InFlightSlot:
    """A KV slot held by an in-flight batch only: position `position` of request `rid`, whose
    row was given back (finish or retraction) while the decode (or prefill) that allocated
    the slot was running. Its page holds no other slot of the request (else it was freed
    with the request's last page). Holds no row."""

    rid: str
    position: int
    slot: int
    kv_freed = False
    req_pool_idx = None


def holds_memory(req: Any) -> bool:
    """A row, something allocated, not yet freed (or an in-flight slot)."""
    if isinstance(req, InFlightSlot):
        return True
    return not req.kv_freed and req.req_pool_idx is not None and req.kv_allocated_len > 0


def held_by_request(req: Any, page_size: int) -> tuple[int, int]:
    """(tokens, pages) a request owns outside the tree; a partly filled last page counts whole."""
    if isinstance(req, InFlightSlot):
        return 1, 1
    if req.kv_freed:
        return 0, 0
    tree_owned = req.last_matched_prefix_len
    tokens = req.kv_allocated_len - tree_owned
    # Pages rounded up by hand: this package imports no other memory module (`pages.cdiv`).
    pages = -(-req.kv_allocated_len // page_size) - tree_owned // page_size
    return tokens, pages


def rows_in_use(stack: Any) -> int:
    pool = stack.req_to_token_pool
    return pool.size - pool.available_size()


def request_rows_check(stack: Any, running: list) -> CheckResult:
    """Rows in use == running (not freed) requests that hold a row."""
    used = rows_in_use(stack)
    with_rows = sum(1 for r in running if r.req_pool_idx is not None)
    return CheckResult("request rows", used == with_rows, f"{used} rows in use, {with_rows} running requests hold one",
                       {"rows_in_use": used, "requests_with_rows": with_rows})


@dataclass(frozen=True)
class Rows:
    """The req_to_token rows of the requests holding memory, concatenated on the host.

    Entry i is position `pos[i]` of request `rids[row[i]]`, held in slot `slots[i]`; a row
    covers positions [0, kv_allocated_len) and its entries are contiguous, in position order.
    """

    rids: list[str]
    tree_lens: np.ndarray
    starts: np.ndarray
    slots: np.ndarray
    row: np.ndarray
    pos: np.ndarray

    def __len__(self) -> int:
        return len(self.rids)

    def slot(self, row: int, pos: int) -> int:
        return int(self.slots[self.starts[row] + pos])

    @cached_property
    def own(self) -> np.ndarray:
        """Per entry: True for the request's own part, False for its cached (tree) prefix."""
        return self.pos >= self.tree_lens[self.row]


def take_rows(stack: Any, reqs: Iterable[Any]) -> Rows:
    """Rows of the requests that hold memory (`holds_memory`); one gather of `req_to_token`.

    An `InFlightSlot` is a row of one entry (its position, its slot) after the request rows."""
    reqs = list(reqs)
    rows = _request_rows(stack, [r for r in reqs if not isinstance(r, InFlightSlot)])
    flying = [r for r in reqs if isinstance(r, InFlightSlot)]
    if not flying:
        return rows
    n, first = len(flying), len(rows.rids)
    positions = np.array([f.position for f in flying], dtype=np.int64)
    return Rows(rows.rids + [f"{f.rid} (in flight)" for f in flying],
                np.concatenate([rows.tree_lens, positions]),
                np.concatenate([rows.starts, len(rows.slots) + np.arange(n, dtype=np.int64)]),
                np.concatenate([rows.slots, np.array([f.slot for f in flying], dtype=np.int64)]),
                np.concatenate([rows.row, first + np.arange(n, dtype=np.int64)]),
                np.concatenate([rows.pos, positions]))


def _request_rows(stack: Any, reqs: list) -> Rows:
    held = [r for r in reqs if holds_memory(r)]
    lens = np.array([r.kv_allocated_len for r in held], dtype=np.int64)
    tree_lens = np.array([r.last_matched_prefix_len for r in held], dtype=np.int64)
    starts = np.cumsum(lens) - lens
    if not held:
        empty = np.empty(0, np.int64)
        return Rows([], tree_lens, starts, empty, empty, empty)
    width = int(lens.max())
    table = stack.req_to_token_pool.req_to_token[:, :width]
    indices = [r.req_pool_idx for r in held]
    if table.device.type == "cpu":
        block = table.numpy()[indices].astype(np.int64)
    else:  # one gather and one transfer of the rows in use
        index = torch.tensor(indices, dtype=torch.int64, device=table.device)
        block = table.index_select(0, index).cpu().numpy().astype(np.int64)
    slots = block[np.arange(width) < lens[:, None]]
    row = np.repeat(np.arange(len(held)), lens)
    pos = np.arange(len(slots)) - np.repeat(starts, lens)
    return Rows([str(r.rid) for r in held], tree_lens, starts, slots, row, pos)
