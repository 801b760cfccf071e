"""NullCache: the tree cache of benchmarks that only exercise allocation.

Caches nothing and never evicts, but frees a finished request's slots and row so a
benchmark can run many rounds. It behaves as `ChunkCache` (no sharing, requests own their
slots) and is built by the stack with the config's page size like every other component;
it exists under its own name so that the page size of the bench path shows as a component
of its own in `check-page-size`.
"""

from __future__ import annotations

from typing import Any

from memcli.check_result import IntegrityReport
from memcli.mem_cache.chunk_cache import ChunkCache


class NullCache(ChunkCache):
    """No-op prefix cache: empty matches, sizes 0, `evict` frees nothing and returns 0."""

    def __init__(self, allocator: Any, req_to_token_pool: Any, page_size: int):
        super().__init__(req_to_token_pool, allocator, page_size)

    def check_integrity(self) -> IntegrityReport:
        report = super().check_integrity()  # the page size it frees rows by
        return IntegrityReport("null cache", report.checks)
