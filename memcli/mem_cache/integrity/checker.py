"""When integrity checks run, and which: the one hook the scheduler calls after every step.

    CheckPolicy.every_step   after every step
      "none"                 nothing (the sampled idle walks below still run)
      "incremental"          `check_step` over the ownership ledger: O(what the step changed)
      "full"                 the full walk (`check_memory`): O(pool), as before the ledger
      "both"                 both, and the ledger compared with the walk (tests on tiny pools)

Idle steps also run the full walk, sampled so that it cannot dominate: at most one walk per
`walk_every` idle steps, and only while the walks so far took at most `walk_budget` of the
wall time since the checker started (the first idle step always walks). With a ledger, the
walk also compares every page's owner with what the walk sees (`verify_ledger`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np

from memcli.check_result import CheckResult, failed, passed
from memcli.errors import IntegrityError
from memcli.mem_cache.integrity.checks import check_memory
from memcli.mem_cache.integrity.incremental import step_failure
from memcli.mem_cache.integrity.layout import take_layout
from memcli.mem_cache.integrity.ownership import FREE, IN_FLIGHT, TREE, OwnershipError, OwnershipLedger, owner_name
from memcli.mem_cache.integrity.requests import InFlightSlot, holds_memory

EVERY_STEP = ("none", "incremental", "full", "both")


@dataclass(frozen=True)
class CheckPolicy:
    """Which checks run after every step, and how often an idle step walks the whole pool."""

    every_step: str = "none"  # none, incremental, full or both (see the module docstring)
    walk_every: int = 16  # idle steps: at most one full walk per this many
    walk_budget: float = 0.05  # idle walks stop while they have taken more than this share of the wall time

    def __post_init__(self) -> None:
        if self.every_step not in EVERY_STEP:
            raise ValueError(f"check every_step {self.every_step!r}: use one of {', '.join(EVERY_STEP)}")
        if self.walk_every < 1 or not 0 <= self.walk_budget <= 1:
            raise ValueError(f"walk_every {self.walk_every} must be >= 1, walk_budget {self.walk_budget} in [0, 1]")

    @property
    def tracks(self) -> bool:
        return self.every_step in ("incremental", "both")


@dataclass
class CheckStats:
    steps_checked: int = 0  # steps after which some check ran
    incremental: int = 0  # incremental checks
    full_walks: int = 0  # full walks (every step under "full", sampled idle walks otherwise)
    incremental_s: float = 0.0
    walk_s: float = 0.0


def track(stack: Any, running: Iterable[Any] = ()) -> OwnershipLedger:
    """Attach an ownership ledger to `stack` (allocator, request pool), seeded from a full walk
    of its current state with the requests `running` that hold memory. Returns it."""
    alloc, pool = stack.allocator, stack.req_to_token_pool
    # Every row of the request table (0.5.23 keeps row 0 as padding: size + 1 rows).
    ledger = OwnershipLedger(alloc.num_pages, alloc.page_size, pool.req_to_token.shape[0], pool.req_to_token)
    running = list(running)
    if not running and alloc.available_size() == alloc.size and stack.tree_cache.total_size() == 0:
        alloc.ledger = pool.ledger = ledger  # an empty stack: every page free, as the ledger starts
        return ledger
    layout = take_layout(stack, running)
    rows, own = layout.rows, []
    for i, req in enumerate([r for r in running if r.req_pool_idx is not None and not r.kv_freed
                             and r.kv_allocated_len > 0]):
        start = rows.starts[i]
        entries = rows.slots[start + req.last_matched_prefix_len: start + req.kv_allocated_len]
        own.append((req.req_pool_idx, entries))
        ledger.row_len[req.req_pool_idx] = req.kv_allocated_len
    ledger.seed(layout.free_pages, layout.tree_slots, own)
    alloc.ledger = pool.ledger = ledger
    return ledger


def untrack(stack: Any) -> None:
    stack.allocator.ledger = stack.req_to_token_pool.ledger = None


class IntegrityChecker:
    """Runs the checks of a `CheckPolicy` after each step; raises `OwnershipError` on the first failure."""

    def __init__(self, stack: Any, policy: CheckPolicy = CheckPolicy(), running: Iterable[Any] = ()):
        self.stack, self.policy = stack, policy
        self.stats = CheckStats()
        self.ledger = track(stack, running) if policy.tracks else None
        if self.ledger is not None and self.ledger.step is None:
            self.ledger.step = 0  # the first step's operations (`after_step` numbers the next ones)
        self._start = time.perf_counter()
        self._idle_since_walk: Optional[int] = None  # None: no idle walk yet

    def reads_holders(self, idle: bool) -> bool:
        """Whether `after_step(..., idle)` may read its `running` list (else the caller need
        not build it): always with the ledger or a walk every step, else on idle steps."""
        return idle or self.ledger is not None or self.policy.every_step in ("full", "both")

    @property
    def checks_runs(self) -> bool:
        """Whether a run of decode steps taken at once can be checked (`after_run`): with no
        check every step, or the incremental one; not the full walk every step."""
        return self.policy.every_step in ("none", "incremental")

    def after_run(self, first: int, steps: int, running: list) -> int:
        """Check a run of `steps` decode steps taken at once, `first` the first one's number,
        as `after_step` would have checked each: one incremental check of what the whole run
        changed (the ledger was told each step under its own number, and what a step leaves
        in a run stays to its end, but for the requests that finish in it: their release is
        judged by the ledger as it goes, and their rows are no longer running at the check,
        as at the check of their own step). A failure names the step that wrote
        the position it finds, else the run's steps (`OwnershipError.step`: the last). Returns
        the steps checked (0 without the ledger: a run has no idle step to walk)."""
        if self.ledger is None:
            return 0
        last = first + steps - 1
        self.ledger.step = last + 1
        self._incremental(last, running, run=(first, steps))
        self.stats.incremental += steps - 1  # one per step covered, as the steps one by one
        self.stats.steps_checked += steps
        return steps

    def after_step(self, step: int, running: list, idle: bool) -> bool:
        """Check step `step` (0-based) as the policy says; True when some check ran."""
        mode, ran = self.policy.every_step, False
        if self.ledger is not None:
            self.ledger.step = step + 1  # operation errors from now on belong to the next step
            self._incremental(step, running)
            ran = True
        if mode in ("full", "both"):
            self._walk(step, running)
            ran = True
        elif idle and self._walk_due():
            self._walk(step, running)
            ran = True
        if ran:
            self.stats.steps_checked += 1
        return ran

    def _incremental(self, step: int, running: list, run: Optional[tuple[int, int]] = None) -> None:
        start = time.perf_counter()
        result = step_failure(self.ledger, self.stack, running)
        if result is not None:
            raise self._failure(step, result, running, run)
        self.stats.incremental += 1
        self.stats.incremental_s += time.perf_counter() - start

    def _failure(self, step: int, result: CheckResult, running: list,
                 run: Optional[tuple[int, int]] = None) -> OwnershipError:
        """The error of a failed step check, with the history of the pages it names; after a
        run (`run`: its first step and length), at the step that wrote the position it names."""
        touches = self.ledger.history_of(suspect_pages(self.ledger, result, running))
        where = f"step {step}"
        if run is not None:
            at = run_step_of(result, running, *run)
            if at is None:
                where = (f"steps {run[0]}-{step} (a decode run checked at its end; --plain-loop checks each step"
                         " on its own)")
            else:
                step, where = at, f"step {at}"
        return OwnershipError(f"{where}: {result.name}: {result.detail}", step, result.name, tuple(touches),
                              self.ledger.story_of(touches))

    def _walk_due(self) -> bool:
        if self._idle_since_walk is None:
            return True
        self._idle_since_walk += 1
        if self._idle_since_walk < self.policy.walk_every:
            return False
        elapsed = time.perf_counter() - self._start
        return self.stats.walk_s <= self.policy.walk_budget * elapsed

    def _walk(self, step: int, running: list) -> None:
        start = time.perf_counter()
        try:
            check_memory(self.stack, running)
        except IntegrityError as exc:
            raise OwnershipError(f"step {step}: full walk: {exc}", step, "full_walk") from None
        if self.ledger is not None:
            result = verify_ledger(self.ledger, self.stack, running)
            if not result.ok:
                raise self._failure(step, result, running)
        self._idle_since_walk = 0
        self.stats.full_walks += 1
        self.stats.walk_s += time.perf_counter() - start


def run_step_of(result: CheckResult, running: list, first: int, steps: int) -> Optional[int]:
    """The step of a run (`first`, `steps` long) that wrote the position a failed check names:
    step `first + j` of the run wrote position `length_before + j` of every running row; None
    when the check names no position, or one written before the run."""
    if not result.positions:
        return None
    pos = max(result.positions)
    held = [r for r in running if result.rid is not None and hasattr(r, "kv_allocated_len")
            and str(r.rid) == result.rid]
    if not held:
        return None
    j = pos - (held[0].kv_allocated_len - steps)
    return first + j if 0 <= j < steps else None


def suspect_pages(ledger: OwnershipLedger, result: CheckResult, running: list) -> list[int]:
    """The pages a failed check points at: those it names (`lost_page` and `ledger` name pages,
    the layout checks slots), else the pages the ledger gives the row of the request it names."""
    if result.slots:
        if result.name in ("lost_page", "ledger"):
            return list(result.slots)
        return list(dict.fromkeys(s // ledger.page_size for s in result.slots if s >= 0))
    rows = [r.req_pool_idx for r in running if result.rid is not None and str(getattr(r, "rid", None)) == result.rid
            and getattr(r, "req_pool_idx", None) is not None]
    return np.flatnonzero(ledger.owner == rows[0]).tolist() if rows else []  # O(pool), only on a failure


def verify_ledger(ledger: OwnershipLedger, stack: Any, running: list) -> CheckResult:
    """The ledger against a full walk: free pages FREE, tree pages TREE, own pages their row's."""
    ledger.settle()
    layout = take_layout(stack, running)
    ps = ledger.page_size
    expected = np.full(ledger.num_pages + 1, -99, dtype=np.int32)  # the ledger's own dtype: half the bytes
    expected[layout.free_pages] = FREE
    if len(layout.tree_slots):
        # Page size 1: the slots are the pages (no pass over every tree slot to divide by 1).
        expected[layout.tree_slots // ps if ps > 1 else layout.tree_slots] = TREE
    rows = layout.rows
    own = np.flatnonzero(rows.own)
    held = [r for r in running if not isinstance(r, InFlightSlot) and holds_memory(r)]
    flying = [r for r in running if isinstance(r, InFlightSlot)]
    if len(own):
        # Owner per row of the walk: the request rows, then one IN_FLIGHT row per in-flight slot.
        row_ids = np.array([r.req_pool_idx for r in held] + [IN_FLIGHT] * len(flying), dtype=np.int64)
        expected[rows.slots[own] // ps] = row_ids[rows.row[own]]
    known = expected != -99
    known[0] = False
    bad = np.flatnonzero(known & (expected != ledger.owner))
    if not len(bad):
        return passed("ledger", f"{np.count_nonzero(known)} pages: the ledger agrees with the walk")
    page = int(bad[0])
    return failed("ledger", f"{ledger.page_label(page)}: the walk sees {owner_name(int(expected[page]))}, the ledger"
                            f" {owner_name(int(ledger.owner[page]))} ({len(bad)} pages disagree)",
                  slots=tuple(int(p) for p in bad[:8]))
