"""The hierarchical cache's per-step host-tier check, which `--check incremental` runs: the
host-tier invariants that need no walk of the tree (host conservation by counters, copies in
flight locked), as the cache answers them (`HiRadixCache.host_tier_checks`).
"""

from __future__ import annotations

from typing import Any

from memcli.check_result import CheckResult, failed, passed


def host_tier_step_check(tree: Any) -> CheckResult:
    """The per-step check (`--check incremental`): host conservation by counters, and copies
    in flight; a failure names the first broken invariant."""
    results = tree.host_tier_checks()
    bad = [r for r in results if not r.ok]
    if bad:
        return failed("host_tier", f"{bad[0].name}: {bad[0].detail}")
    return passed("host_tier", "; ".join(r.detail for r in results))
