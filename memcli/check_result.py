"""The one result vocabulary of every integrity check: `CheckResult`, grouped per component
in an `IntegrityReport`.

A check never raises by itself: it answers a `CheckResult` that says whether the invariant
holds, with the numbers behind the verdict. Callers that want an exception call
`IntegrityReport.raise_if_failed()` or `raise_failures()`.

A leaf shared by every layer, as `memcli.errors`: the memory components answer their own
`check_integrity()` in it (allocator, request table, caches), the stack-wide checks of
`memcli.mem_cache.integrity` and the tools build on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Optional

from memcli.errors import IntegrityError

MAX_OFFENDERS = 8  # slots / positions kept on a result: enough to point at, never a dump


@dataclass(frozen=True)
class CheckResult:
    """One invariant: its name, whether it holds, the numbers, and what breaks it.

    `detail` always carries the numbers, also when the check passes
    (`evictable 96 + protected 32 == total 128`); `numbers` holds them by name where a caller
    reads them. On a failure, `rid`, `positions` and `slots` name the offender (each tuple
    capped at `MAX_OFFENDERS`); `step` is filled in by whoever ran the check (`at_step`).
    """

    name: str
    ok: bool
    detail: str
    numbers: Mapping[str, int] = field(default_factory=dict, compare=False)
    rid: Optional[str] = None
    positions: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()
    step: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "positions", tuple(self.positions)[:MAX_OFFENDERS])
        object.__setattr__(self, "slots", tuple(self.slots)[:MAX_OFFENDERS])

    def at_step(self, step: int) -> CheckResult:
        return replace(self, step=step)

    def to_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}

    def __str__(self) -> str:
        return f"[{'ok' if self.ok else 'FAIL'}] {self.name}: {self.detail}"


def passed(name: str, detail: str, **numbers: int) -> CheckResult:
    return CheckResult(name, True, detail, numbers)


def failed(name: str, detail: str, rid: Optional[str] = None, positions: tuple[int, ...] = (),
           slots: tuple[int, ...] = (), **numbers: int) -> CheckResult:
    return CheckResult(name, False, detail, numbers, rid, positions, slots)


def failures(results: Iterable[CheckResult]) -> list[CheckResult]:
    """The results that failed, in order."""
    return [result for result in results if not result.ok]


def joined(results: Iterable[CheckResult]) -> str:
    """`name: detail; name: detail` over `results`."""
    return "; ".join(f"{r.name}: {r.detail}" for r in results)


@dataclass(frozen=True)
class IntegrityReport:
    """All checks run on one component (`component` names it, e.g. `radix cache`)."""

    component: str
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def failures(self) -> list[CheckResult]:
        return failures(self.checks)

    def check(self, name: str) -> CheckResult:
        """The check called `name`; KeyError when the report has none."""
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(f"{self.component} report has no check {name!r}; it has {[c.name for c in self.checks]}")

    def raise_if_failed(self) -> None:
        """Raise `IntegrityError` listing every failed check; return None when all hold."""
        if not self.ok:
            raise IntegrityError(f"{self.component} integrity check failed: {joined(self.failures)}")

    def to_dict(self) -> dict:
        return {"component": self.component, "ok": self.ok, "checks": [c.to_dict() for c in self.checks]}

    def __str__(self) -> str:
        head = f"{self.component}: {'ok' if self.ok else f'{len(self.failures)} check(s) failed'}"
        return "\n".join([head, *(f"  {check}" for check in self.checks)])
