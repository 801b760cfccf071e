"""What `check-page-size` found: one `PageSizeRun` per page size checked, and the
`CheckPageSizeResult` of the whole command (its verdict, exit code and comparison rows)."""

from __future__ import annotations

from dataclasses import dataclass, field

from memcli.tools.check_page_size.dynamic import PhaseResult
from memcli.tools.check_page_size.static import PageCost, StaticResult
from memcli.tools.check_page_size.workload import Adjustment


@dataclass(frozen=True)
class PageSizeRun:
    """Everything checked at one page size."""

    page_size: int
    static: StaticResult
    cost: PageCost
    static_adjustments: list[Adjustment]
    dynamic_adjustments: list[Adjustment]
    phases: list[PhaseResult]
    notes: list[str] = field(default_factory=list)
    steps_to_finish: int = 0  # the workload run one request after another (`Workload.steps_one_by_one`)

    @property
    def ok(self) -> bool:
        return self.static.ok and all(p.ok for p in self.phases)

    @property
    def first_violation(self):
        return next((p.violation for p in self.phases if p.violation is not None), None)

    @property
    def unfinished_phases(self) -> list[PhaseResult]:
        return [p for p in self.phases if p.unfinished]

    def to_dict(self) -> dict:
        return {
            "page_size": self.page_size,
            "ok": self.ok,
            "static": self.static.to_dict(),
            "cost": self.cost.to_dict(),
            "static_adjustments": [a.to_dict() for a in self.static_adjustments],
            "dynamic_adjustments": [a.to_dict() for a in self.dynamic_adjustments],
            "phases": [p.to_dict() for p in self.phases],
            "notes": self.notes,
            "steps_to_finish": self.steps_to_finish,
        }


@dataclass(frozen=True)
class CheckPageSizeResult:
    workload: str
    steps: int
    injections: dict[str, int]
    runs: list[PageSizeRun]
    semantics: str  # the profile the dynamic workload runs under, with its overrides
    allow_unfinished: bool = False

    @property
    def ok(self) -> bool:
        """Every check passed (requests stopped at the step limit are not a failed check)."""
        return all(run.ok for run in self.runs)

    @property
    def unfinished(self) -> int:
        """Requests stopped unfinished at the step limit, over every phase and page size."""
        return sum(p.unfinished for run in self.runs for p in run.phases)

    @property
    def steps_hint(self) -> int:
        """A --steps that finishes every request of the workload at every page size checked."""
        return max((run.steps_to_finish for run in self.runs), default=0)

    @property
    def exit_code(self) -> int:
        """1 when a check failed, or when requests did not finish and --allow-unfinished is off."""
        return 0 if self.ok and (self.allow_unfinished or not self.unfinished) else 1

    def comparison(self) -> list[dict]:
        """One row per page size: verdicts, costs and what the main phase measured."""
        rows = []
        for run in self.runs:
            main = run.phases[0] if run.phases else None
            cov = main.coverage if main else {}
            violation = run.first_violation
            rows.append({
                "page_size": run.page_size,
                "static_ok": run.static.ok,
                "dynamic_ok": all(p.ok for p in run.phases) if run.phases else None,
                "steps": main.steps if main else 0,
                "cached_tokens": cov.get("cached_tokens"),
                "radix_hits": cov.get("radix_hits"),
                "evictions": cov.get("evictions"),
                "pressure_retractions": cov.get("pressure_retractions"),
                "forced_retractions": cov.get("forced_retractions"),
                "unfinished": sum(p.unfinished for p in run.phases) if run.phases else None,
                "expected_waste_per_request": run.cost.waste_per_request,
                "measured_waste_per_request": cov.get("mean_partial_page_waste"),
                "shortest_hit_prefix": run.cost.shortest_hit,
                "reuse_lost_per_divergence": run.cost.reuse_lost_per_divergence,
                "first_violation": f"step {violation.step}: {violation.name}" if violation else None,
            })
        return rows

    def to_dict(self) -> dict:
        """The fields of the --json document (its envelope carries the config and profile)."""
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "workload": self.workload,
            "steps": self.steps,
            "unfinished": self.unfinished,
            "allow_unfinished": self.allow_unfinished,
            "steps_to_finish": self.steps_hint,
            "injections": {f"{k}.page_size": v for k, v in self.injections.items()},
            "runs": [run.to_dict() for run in self.runs],
            "comparison": self.comparison(),
        }
