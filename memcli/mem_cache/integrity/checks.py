"""The entry points: every check over the whole stack, at two grains.

`run_checks` answers the per-step page-level checks in `CHECK_NAMES` order (what
`check-page-size` reports); `memory_reports` groups the stack-wide checks per component (what
`replay` prints); `check_memory` raises on the first failing report (scheduler, replay). Both
grains share one conservation, one idle and one tree implementation.
"""

from __future__ import annotations

from typing import Any, Iterable

from memcli.check_result import CheckResult, IntegrityReport, joined
from memcli.errors import IntegrityError
from memcli.mem_cache.integrity.conservation import check_conservation, check_idle, memory_report
from memcli.mem_cache.integrity.layout import (
    check_free_list, check_no_lost_page, check_page_sharing, check_row_layout, check_slot_range, take_layout,
)
from memcli.mem_cache.integrity.radix import check_tree

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


def run_checks(stack: Any, running: Iterable[Any] = (), deep: bool = True) -> list[CheckResult]:
    """Every page-level check, in `CHECK_NAMES` order, over the requests `running` that hold memory.

    Reads only. `deep=False` skips the prefix cache's own `check_integrity()` walk (the tree
    check still verifies sizes and pages); callers checking every step run the walk now and then."""
    running = list(running)
    layout = take_layout(stack, running)
    return [
        check_row_layout(layout),
        check_slot_range(layout),
        check_page_sharing(layout),
        check_free_list(layout),
        check_no_lost_page(layout),
        check_conservation(stack, running),
        check_tree(stack, layout, deep),
        check_idle(stack, running),
    ]


def memory_reports(stack: Any, running: Iterable[Any] = (), deep: bool = True) -> list[IntegrityReport]:
    """The "memory" report (conservation, request rows, idle) plus, when `deep`, the allocator's,
    the request pool's and the prefix cache's own reports. Reads only."""
    reports = [memory_report(stack, running)]
    if deep:
        reports.append(stack.allocator.check_integrity())
        reports.append(stack.req_to_token_pool.check_integrity())
        reports.append(stack.tree_cache.check_integrity())
    return reports


def check_memory(stack: Any, running: Iterable[Any] = (), deep: bool = True) -> list[IntegrityReport]:
    """`memory_reports`, raising `IntegrityError` with every number on the first failing report,
    in the style `memory leak detected! available_size=..., evictable_size=..., protected_size=...`."""
    reports = memory_reports(stack, running, deep)
    for report in reports:
        if not report.ok:
            alloc, tree = stack.allocator, stack.tree_cache
            raise IntegrityError(
                f"memory leak detected! available_size={alloc.available_size()},"
                f" evictable_size={tree.evictable_size()}, protected_size={tree.protected_size()},"
                f" max_total_num_tokens={alloc.size}\n" + joined(report.failures)
            )
    return reports
