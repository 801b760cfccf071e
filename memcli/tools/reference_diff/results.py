"""The result of one `reference diff` run: what was asked and what the side-by-side run found."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from memcli.config import Config

if TYPE_CHECKING:
    from memcli.reference.observe import StepDiff
    from memcli.tools.diff.compare import LogDiff


@dataclass(frozen=True)
class ReferenceDiffResult:
    """`trace` as given on the command line, `limit` (None: the whole trace) and `arrivals`
    as asked, the config both sides ran, and `diff`, the side-by-side run
    (`memcli.reference.observe.StepDiff`: steps compared, the first divergence, a failure);
    `steps`, both sides' step logs compared (A: the engine's own code, B: memcli)."""

    trace: str
    limit: Optional[int]
    arrivals: str
    config: Config
    diff: StepDiff
    steps: Optional["LogDiff"] = None

    @property
    def equal(self) -> bool:
        """Both sides took the same steps to the end (or to --max-steps), and neither raised."""
        return self.diff.divergence is None and self.diff.failure is None

    @property
    def exit_code(self) -> int:
        """0 when equal, 1 when the sides diverged or one raised."""
        return 0 if self.equal else 1
