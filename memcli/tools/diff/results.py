"""The result of `memcli diff`: what was compared, and how the two step logs differ."""

from __future__ import annotations

from dataclasses import dataclass

from memcli.tools.diff.compare import LogDiff


@dataclass(frozen=True)
class DiffResult:
    """`a` and `b` say what each side is (a log file, or the trace's replay under its options);
    `notes` how a side's replay ended early, when it did; `diff` the comparison."""

    a: str
    b: str
    diff: LogDiff
    notes: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        """0 when the logs are equal, 1 when they differ."""
        return 0 if self.diff.equal else 1
