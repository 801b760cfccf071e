"""Integrity checks of the memory stack, in one result vocabulary (`CheckResult`, of
`memcli.check_result`).

    requests      req_to_token rows, what a request holds, the request-rows check
    layout        page layout: row_layout, slot_range, page_sharing, free_list, no_lost_page
    conservation  conservation (tokens, pages) and idle
    radix         the per-step tree check (the walks themselves: `memcli.mem_cache.tree_checks`)
    host_tier     the per-step host-tier check
    checks        the entry points: run_checks, memory_reports, check_memory
    owners        who owns a page: the owner codes the operations name (FREE, TREE, ...)
    ownership     the ownership ledger: who owns each page, kept by the operations (checking only)
    history       every transition the ledger made: the story of a failure's pages (`Touch`)
    incremental   the per-step check over the ledger: O(what the step changed)
    checker       when checks run: CheckPolicy, IntegrityChecker (the scheduler's hook), track

The checks read the stack (allocator, request table, tree cache) through public interfaces,
duck-typed: nothing here imports another module of `memcli.mem_cache`, so the memory code
may import this package (the owner codes, the checker) without a circle. The allocator and
the request table import nothing of it: the ledger is their observer
(`allocator.AllocationObserver`, `pools.RowObserver`).
"""

from memcli.check_result import (
    MAX_OFFENDERS, CheckResult, IntegrityReport, failed, failures, joined, passed,
)
from memcli.mem_cache.integrity.checks import CHECK_NAMES, check_memory, memory_reports, run_checks
from memcli.mem_cache.integrity.requests import InFlightSlot, held_by_request
from memcli.mem_cache.integrity.history import Touch, page_label, story
from memcli.mem_cache.integrity.ownership import OwnershipError
from memcli.mem_cache.integrity.checker import CheckPolicy, CheckStats, IntegrityChecker, track, untrack

__all__ = [
    "CHECK_NAMES", "MAX_OFFENDERS", "CheckPolicy", "CheckStats", "InFlightSlot", "IntegrityChecker", "OwnershipError", "track",
    "untrack", "CheckResult", "IntegrityReport", "check_memory", "failed", "failures",
    "held_by_request", "joined", "memory_reports", "passed", "run_checks", "Touch", "page_label", "story",
]
