"""Leak and integrity checks over the whole stack.

Conservation, in tokens and in pages:

    available + evictable + protected + held_by_running == size

`held_by_running` counts what running requests own outside the tree: positions
`[tree_owned, kv_allocated_len)` of their rows, rounded up to whole pages (the allocator
hands out pages, so a partly filled last page is held in full; the gap is the partial-page
waste). At idle: no request row in use and `available + evictable == size`.
"""

from __future__ import annotations

from typing import Iterable

from memcli.errors import IntegrityError
from memcli.mem_cache.allocator import cdiv
from memcli.mem_cache.integrity import Check, IntegrityReport


def held_by_request(req, page_size: int) -> tuple[int, int]:
    """(tokens, pages) a request owns outside the tree."""
    if req.kv_freed:
        return 0, 0
    tree_owned = req.last_matched_prefix_len
    tokens = req.kv_allocated_len - tree_owned
    pages = cdiv(req.kv_allocated_len, page_size) - tree_owned // page_size
    return tokens, pages


def conservation(stack, running: Iterable) -> IntegrityReport:
    allocator, tree = stack.allocator, stack.tree_cache
    ps = allocator.page_size
    running = [r for r in running if not r.kv_freed]
    held_tokens = held_pages = 0
    for req in running:
        tokens, pages = held_by_request(req, ps)
        held_tokens += tokens
        held_pages += pages
    avail, evictable, protected = allocator.available_size(), tree.evictable_size(), tree.protected_size()
    total = avail + evictable + protected + held_pages * ps
    checks = [
        Check(
            "conservation (tokens)",
            total == allocator.size,
            f"available {avail} + evictable {evictable} + protected {protected} + held {held_pages * ps}"
            f" (of which {held_pages * ps - held_tokens} partial-page waste) = {total} vs size {allocator.size}",
        )
    ]
    if ps > 1:
        tree_pages_ok = evictable % ps == 0 and protected % ps == 0
        total_pages = avail // ps + evictable // ps + protected // ps + held_pages
        checks.append(
            Check(
                "conservation (pages)",
                tree_pages_ok and total_pages == allocator.num_pages,
                f"free {avail // ps} + evictable {evictable / ps:g} + protected {protected / ps:g} + held"
                f" {held_pages} = {total_pages} vs {allocator.num_pages} pages",
            )
        )
    pool = stack.req_to_token_pool
    rows_used = pool.size - pool.available_size()
    with_rows = sum(1 for r in running if r.req_pool_idx is not None)
    checks.append(
        Check("request rows", rows_used == with_rows,
              f"{rows_used} rows in use, {with_rows} running requests hold one")
    )
    if not running:
        checks.append(
            Check("idle: everything free", avail + evictable == allocator.size and protected == 0,
                  f"available {avail} + evictable {evictable} vs size {allocator.size}, protected {protected}")
        )
    return IntegrityReport("memory", checks)


def check_memory(stack, running: Iterable = (), deep: bool = True) -> list[IntegrityReport]:
    """Conservation plus (when `deep`) the allocator check and the tree walk.

    Raises `IntegrityError` with every number on the first failing report, in the style
    `memory leak detected! available_size=..., evictable_size=..., protected_size=...`.
    """
    reports = run_checks(stack, running, deep)
    for report in reports:
        if not report.ok:
            alloc, tree = stack.allocator, stack.tree_cache
            raise IntegrityError(
                f"memory leak detected! available_size={alloc.available_size()},"
                f" evictable_size={tree.evictable_size()}, protected_size={tree.protected_size()},"
                f" max_total_num_tokens={alloc.size}\n" + "; ".join(f"{c.name}: {c.detail}" for c in report.failures)
            )
    return reports


def run_checks(stack, running: Iterable = (), deep: bool = True) -> list[IntegrityReport]:
    running = list(running)
    reports = [conservation(stack, running)]
    if deep:
        reports.append(stack.allocator.check_integrity())
        reports.append(stack.req_to_token_pool.check_integrity())
        reports.append(stack.tree_cache.check_integrity())
    return reports
