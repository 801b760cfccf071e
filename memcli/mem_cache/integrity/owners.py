"""Who owns a KV page: the vocabulary the memory operations use to tell the ownership ledger
(`ownership`, while checking) where pages go.

A page (a slot when page_size == 1) is owned by one of:

    FREE       in the allocator's free list (or its pending release list)
    LOOSE      out of the allocator, owned by nobody: between an alloc and its claim, or between
               a release and the allocator's free
    TREE       a radix tree node
    CARRIED    a chunked request's partial page while it has no request row
    IN_FLIGHT  a decode slot held only by a batch in flight (overlap scheduling)
    r >= 0     request row r

PADDING (page 0) and OUTSIDE (past the last page) are no owner: no transition starts there.
A leaf: the caches, the allocation entry points and the ledger import it; it imports nothing.
(The allocator and the request table need none of it: they pass on what their callers name.)
"""

from __future__ import annotations

FREE, LOOSE, TREE, CARRIED, PADDING, IN_FLIGHT, OUTSIDE = -1, -2, -3, -4, -5, -6, -7

OWNER_NAMES = {
    FREE: "free", LOOSE: "nobody (allocated, unclaimed)", TREE: "the tree", CARRIED: "a chunked request (carried)",
    PADDING: "padding (page 0)", IN_FLIGHT: "a decode slot in flight (overlap)", OUTSIDE: "nobody (outside the pool)",
}


def owner_name(owner: int) -> str:
    """`the tree`, `free`, ..., or `request row 7`."""
    return OWNER_NAMES.get(int(owner), f"request row {int(owner)}")
