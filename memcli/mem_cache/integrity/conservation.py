"""Conservation and idle: the pool's accounting, one implementation each.

Conservation, in tokens and in pages (DESIGN 2.3):

    available + evictable + protected + held_by_running == size

`held_by_running` counts what running requests own outside the tree: positions
`[tree_owned, kv_allocated_len)` of their rows, rounded up to whole pages (the allocator
hands out pages, so a partly filled last page is held in full; the gap is the partial-page
waste). Idle (DESIGN 2.6): no request holds memory, no request row in use, nothing protected,
and `available + evictable == size`.
"""

from __future__ import annotations

from typing import Any, Iterable

from memcli.check_result import CheckResult, IntegrityReport, failures, joined
from memcli.mem_cache.integrity.requests import held_by_request, holds_memory, request_rows_check, rows_in_use

IDLE_REPORT_NAME = "idle: everything free"  # the idle check's name in the "memory" report


def conservation_checks(stack: Any, running: list) -> list[CheckResult]:
    """`conservation (tokens)`, and `conservation (pages)` when page_size > 1.

    `running` are the requests not yet freed."""
    allocator, tree = stack.allocator, stack.tree_cache
    ps = allocator.page_size
    held_tokens = held_pages = 0
    for req in running:
        tokens, pages = held_by_request(req, ps)
        held_tokens += tokens
        held_pages += pages
    avail, evictable, protected = allocator.available_size(), tree.evictable_size(), tree.tree_protected_size()
    total = avail + evictable + protected + held_pages * ps
    numbers = {"available": avail, "evictable": evictable, "protected": protected, "held": held_pages * ps,
               "size": allocator.size}
    checks = [
        CheckResult(
            "conservation (tokens)",
            total == allocator.size,
            f"available {avail} + evictable {evictable} + protected {protected} + held {held_pages * ps}"
            f" (of which {held_pages * ps - held_tokens} partial-page waste) = {total} vs size {allocator.size}",
            numbers,
        )
    ]
    if ps > 1:
        tree_pages_ok = evictable % ps == 0 and protected % ps == 0
        total_pages = avail // ps + evictable // ps + protected // ps + held_pages
        checks.append(
            CheckResult(
                "conservation (pages)",
                tree_pages_ok and total_pages == allocator.num_pages,
                f"free {avail // ps} + evictable {evictable / ps:g} + protected {protected / ps:g} + held"
                f" {held_pages} = {total_pages} vs {allocator.num_pages} pages",
                {"total_pages": total_pages, "num_pages": allocator.num_pages},
            )
        )
    return checks


def accounting_checks(stack: Any, reqs: Iterable[Any]) -> list[CheckResult]:
    """Conservation (tokens, pages) and request rows over the requests not yet freed."""
    running = [r for r in reqs if not r.kv_freed]
    return [*conservation_checks(stack, running), request_rows_check(stack, running)]


def check_conservation(stack: Any, reqs: Iterable[Any]) -> CheckResult:
    """One `conservation` verdict: tokens, pages and request rows (the failed ones, else tokens)."""
    checks = accounting_checks(stack, reqs)
    bad = failures(checks)
    return CheckResult("conservation", not bad, joined(bad or checks[:1]))


def check_idle(stack: Any, reqs: Iterable[Any]) -> CheckResult:
    """With no request holding memory: no request row in use, nothing protected,
    available + evictable == size. Passes ("not idle") while a request holds memory."""
    holding = sum(1 for r in reqs if holds_memory(r))
    if holding:
        return CheckResult("idle", True, f"not idle ({holding} requests hold memory)", {"holding": holding})
    allocator, tree = stack.allocator, stack.tree_cache
    used = rows_in_use(stack)
    avail, evictable, protected = allocator.available_size(), tree.evictable_size(), tree.tree_protected_size()
    copying = tree.copy_protected_size()  # host tier: nodes locked by their copies in flight
    detail = (f"{used} request rows in use; available {avail} + evictable {evictable} (+ {copying} locked by copies"
              f" in flight) vs size {allocator.size}; protected {protected}")
    ok = not used and protected == copying and avail + evictable + copying == allocator.size
    numbers = {"holding": 0, "rows_in_use": used, "available": avail, "evictable": evictable,
               "protected": protected, "size": allocator.size}
    return CheckResult("idle", ok, detail if ok else "idle but not everything is free: " + detail, numbers)


def memory_report(stack: Any, reqs: Iterable[Any]) -> IntegrityReport:
    """The stack-wide "memory" report: conservation, request rows, and (at idle) the idle check
    under its report name, with the report's numbers."""
    reqs = list(reqs)
    checks = accounting_checks(stack, reqs)
    idle = check_idle(stack, reqs)
    if idle.numbers["holding"] == 0:
        n = idle.numbers
        checks.append(CheckResult(IDLE_REPORT_NAME, idle.ok, f"available {n['available']} + evictable"
                                  f" {n['evictable']} vs size {n['size']}, protected {n['protected']}", n))
    return IntegrityReport("memory", checks)
