"""Output of `memcli diff` (and the step comparison `reference diff` prints): the first divergent
step with the steps around it, what differs there, and the requests whose cached tokens differ."""

from __future__ import annotations

from typing import Any, Optional

from memcli.report.envelope import envelope
from memcli.tools.diff.compare import LogDiff, Step, describe
from memcli.tools.diff.results import DiffResult

REQUESTS_SHOWN = 20
HEADER = (f"{'':2}{'step':>7} {'':1} {'t_ms':>12} {'kind':<7} {'reqs':>5} {'new':>8} {'cached':>8} {'retr':>4}"
          f" {'fin':>4} {'abrt':>4} {'evicted':>8} {'used':>10} {'evictable':>10} {'protected':>10} {'free':>10}")


def diff_document(result: DiffResult) -> dict[str, Any]:
    """The --json document: the envelope (no config: each side has its own), then the comparison."""
    return envelope("diff", {"a": result.a, "b": result.b, "notes": list(result.notes), **diff_fields(result.diff)})


def diff_fields(diff: LogDiff) -> dict[str, Any]:
    first = None
    if diff.first is not None:
        a, b = diff.at
        first = {"position": diff.first, "step": (a or b)["step"], "fields": list(diff.fields), "what": describe(a, b),
                 "before": [list(pair) for pair in diff.before], "at": [a, b],
                 "after": [list(pair) for pair in diff.after]}
    return {
        "equal": diff.equal, "steps_a": diff.steps_a, "steps_b": diff.steps_b, "first_divergence": first,
        "cached_tokens": {"requests": diff.requests_seen, "differing_requests": len(diff.requests),
                          "a": diff.cached_a, "b": diff.cached_b,
                          "differing": [{"rid": r.rid, "a": r.a, "b": r.b} for r in diff.requests]},
    }


def render(result: DiffResult) -> str:
    lines = [f"A: {result.a}", f"B: {result.b}", *(f"note: {note}" for note in result.notes)]
    return "\n".join([*lines, *render_diff(result.diff)])


def render_diff(diff: LogDiff) -> list[str]:
    """The comparison as text lines (shared with `reference diff`)."""
    if diff.equal:
        return [f"equal: {diff.steps_a:,} steps, the same batches, cached tokens, evictions and sizes"
                f" ({diff.cached_a:,} cached tokens over {diff.requests_seen:,} requests)"]
    lines = []
    if diff.first is not None:
        a, b = diff.at
        lines += [f"first divergent step: {(a or b)['step']} (A has {diff.steps_a:,} steps, B {diff.steps_b:,});"
                  f" differs: {', '.join(diff.fields)}", HEADER]
        for x, y in diff.before:
            lines += [_row(x, "A", " "), _row(y, "B", " ", same_as=x)]
        lines += [_row(a, "A", ">"), _row(b, "B", ">")]
        for x, y in diff.after:
            lines += [_row(x, "A", " "), _row(y, "B", " ", same_as=x)]
        lines += [f"at step {(a or b)['step']}:"] + [f"  {line}" for line in describe(a, b)]
    lines.append(_requests_line(diff))
    for r in diff.requests[:REQUESTS_SHOWN]:
        lines.append(f"  request {r.rid}: A {_num(r.a)}, B {_num(r.b)}")
    if len(diff.requests) > REQUESTS_SHOWN:
        lines.append(f"  ... and {len(diff.requests) - REQUESTS_SHOWN} more (--json lists them all)")
    return lines


def _requests_line(diff: LogDiff) -> str:
    if not diff.requests:
        return f"per-request cached tokens: the same for all {diff.requests_seen:,} requests ({diff.cached_a:,} in all)"
    return (f"per-request cached tokens: {len(diff.requests):,} of {diff.requests_seen:,} requests differ"
            f" (A {diff.cached_a:,}, B {diff.cached_b:,} in all)")


def _num(value: Optional[int]) -> str:
    return "never admitted" if value is None else f"{value:,}"


def _row(step: Step, side: str, mark: str, same_as: Step = None) -> str:
    if step is None:
        return f"{mark:2}{'':7} {side} (the log has ended)"
    if same_as is not None and step == same_as:
        return f"{mark:2}{'':7} {side} (the same)"
    reqs = step["requests"]
    return (f"{mark:2}{step['step']:>7} {side} {step['t_ms']:>12.3f} {step['kind']:<7} {len(reqs):>5}"
            f" {sum(e['new'] for e in reqs):>8} {sum(e['cached'] for e in reqs):>8} {len(step['retracted']):>4}"
            f" {len(step['finished']):>4} {len(step['aborted']):>4} {step['evicted_tokens']:>8} {step['used']:>10}"
            f" {step['evictable']:>10} {step['protected']:>10} {step['free']:>10}")
