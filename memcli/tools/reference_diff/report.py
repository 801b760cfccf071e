"""Output of `reference diff`: the text report and the `--json` document (docs/JSON.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

from memcli.report.envelope import envelope
from memcli.tools.diff.report import diff_fields, render_diff
from memcli.tools.reference_diff.results import ReferenceDiffResult


def diff_document(result: ReferenceDiffResult) -> dict[str, Any]:
    """The --json document: the envelope, then the run and, when they diverged, both sides'
    observations at the first divergent step; `step_logs`, both sides' step logs compared in
    the shape of `memcli diff --json` (A: the engine's own code, B: memcli)."""
    diff = result.diff
    divergence = None
    if diff.divergence is not None:
        sglang, memcli = diff.divergence
        divergence = {"step": sglang.step, "fields": sglang.differing(memcli),
                      _reference_key(result): dataclasses.asdict(sglang), "memcli": dataclasses.asdict(memcli)}
    return envelope("reference diff", {
        "trace": result.trace, "limit": result.limit, "arrivals": result.arrivals, "event_loop": diff.event_loop,
        "steps": diff.steps, "divergent": diff.divergence is not None, "first_divergence": divergence,
        "reference_s": round(diff.reference_s, 3), "memcli_s": round(diff.memcli_s, 3),
        "notes": list(diff.notes), "failure": diff.failure,
        "step_logs": None if result.steps is None else {"a": "the engine's own code", "b": "memcli",
                                                         **diff_fields(result.steps)},
    }, result.config)


def _reference_key(result: ReferenceDiffResult) -> str:
    """What the reference side is called: the run's own name for it (`sglang` when it has none)."""
    return getattr(result.diff, "reference", "sglang")


def render(result: ReferenceDiffResult) -> str:
    """The first divergent step with both sides' observations, `0 divergent steps in S steps`,
    or one `failed:` line; each with the loop and both sides' run times."""
    diff = result.diff
    times = f"{diff.event_loop} loop; reference {diff.reference_s:.2f} s, memcli {diff.memcli_s:.2f} s"
    notes = [f"note: {note}" for note in diff.notes]
    if diff.failure is not None:
        return "\n".join([*notes, f"failed: {diff.failure}", f"{diff.steps} steps compared before it ({times})"])
    if diff.divergence is None:
        return "\n".join([*notes, f"0 divergent steps in {diff.steps} steps ({times})", *_step_logs(result)])
    sglang, memcli = diff.divergence
    lines = [*notes, f"first divergent step: {sglang.step} (fields: {', '.join(sglang.differing(memcli)) or 'done'})",
             f"  {_reference_key(result)}:"] + [f"    {line}" for line in sglang.lines()]
    lines += ["  memcli:"] + [f"    {line}" for line in memcli.lines()]
    lines.append(f"{diff.steps} steps run ({times})")
    return "\n".join([*lines, *_step_logs(result)])


def _step_logs(result: ReferenceDiffResult) -> list[str]:
    """Both sides' step logs compared, in the shape of `memcli diff`."""
    if result.steps is None:
        return []
    return ["step logs (A: the engine's own code, B: memcli):", *render_diff(result.steps)]
