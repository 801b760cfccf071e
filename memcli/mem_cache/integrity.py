"""Integrity reports: named checks with the numbers behind each verdict.

Every component of the memory stack (allocators, prefix caches) answers
`check_integrity()` with an `IntegrityReport`. A report never raises by itself; callers
that want an exception call `raise_if_failed()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memcli.errors import IntegrityError


@dataclass(frozen=True)
class Check:
    """One invariant: its name, whether it holds, and the numbers that show it.

    `detail` always carries the numbers, also when the check passes
    (`evictable 96 + protected 32 == total 128`).
    """

    name: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"[{'ok' if self.ok else 'FAIL'}] {self.name}: {self.detail}"


@dataclass(frozen=True)
class IntegrityReport:
    """All checks run on one component (`component` names it, e.g. `radix cache`)."""

    component: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [check for check in self.checks if not check.ok]

    def check(self, name: str) -> Check:
        """The check called `name`; KeyError when the report has none."""
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(f"{self.component} report has no check {name!r}; it has {[c.name for c in self.checks]}")

    def raise_if_failed(self) -> None:
        """Raise `IntegrityError` listing every failed check; return None when all hold."""
        if not self.ok:
            lines = "; ".join(f"{c.name}: {c.detail}" for c in self.failures)
            raise IntegrityError(f"{self.component} integrity check failed: {lines}")

    def to_dict(self) -> dict:
        return {
            "component": self.component,
            "ok": self.ok,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
        }

    def __str__(self) -> str:
        head = f"{self.component}: {'ok' if self.ok else f'{len(self.failures)} check(s) failed'}"
        return "\n".join([head, *(f"  {check}" for check in self.checks)])
