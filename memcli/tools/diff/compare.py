"""Two step logs compared step by step: the first step where they differ (with context), what
differs there, and the cached tokens of every request over the whole run.

Steps are paired by position. Compared are the fields of `steplog.FIELDS` (an engine's own
fields under `engine` are not); a log that ends first differs at the first step it lacks.
A request's cached tokens are the sum of its `cached` over the log (one entry per admission).
"""

from __future__ import annotations

from collections import deque
from itertools import zip_longest
from typing import Any, Iterable, NamedTuple, Optional

from memcli.tools.replay.steplog import FIELDS

Step = Optional[dict[str, Any]]  # None: the log has ended


class RequestDiff(NamedTuple):
    rid: str
    a: Optional[int]  # cached tokens in A (None: never admitted there)
    b: Optional[int]


class LogDiff(NamedTuple):
    """`first`: the position of the first divergent step (None: equal); `fields` differing there;
    `before`, `at`, `after`: (A, B) pairs of the steps around it; `requests`: every request whose
    cached tokens differ, in order of first appearance."""

    steps_a: int
    steps_b: int
    first: Optional[int]
    fields: tuple[str, ...]
    before: tuple[tuple[Step, Step], ...]
    at: Optional[tuple[Step, Step]]
    after: tuple[tuple[Step, Step], ...]
    requests: tuple[RequestDiff, ...]
    requests_seen: int
    cached_a: int
    cached_b: int

    @property
    def equal(self) -> bool:
        return self.first is None and not self.requests


def differing(a: Step, b: Step) -> tuple[str, ...]:
    """The compared fields that differ (every field when one side has ended)."""
    if a is None or b is None:
        return FIELDS
    return tuple(name for name in FIELDS if a[name] != b[name])


def compare_logs(a: Iterable[dict], b: Iterable[dict], context: int = 3) -> LogDiff:
    """Walk both logs to their ends (each is read once, as it streams)."""
    before: deque = deque(maxlen=context)
    after: list = []
    first, fields, at = None, (), None
    cached: dict[str, list] = {}
    steps = [0, 0]
    for position, (x, y) in enumerate(zip_longest(a, b)):
        for side, step in enumerate((x, y)):
            if step is not None:
                steps[side] += 1
                for entry in step["requests"]:
                    totals = cached.setdefault(entry["rid"], [None, None])
                    totals[side] = (totals[side] or 0) + entry["cached"]
        if first is None:
            names = differing(x, y)
            if names:
                first, fields, at = position, names, (x, y)
            else:
                before.append((x, y))
        elif len(after) < context:
            after.append((x, y))
    requests = tuple(RequestDiff(rid, ca, cb) for rid, (ca, cb) in cached.items() if ca != cb)
    return LogDiff(steps[0], steps[1], first, fields, tuple(before), at, tuple(after), requests, len(cached),
                   sum(t[0] or 0 for t in cached.values()), sum(t[1] or 0 for t in cached.values()))


def describe(a: Step, b: Step) -> list[str]:
    """What differs between two steps, one line per field, in the log's own terms."""
    if a is None or b is None:
        ended, other = ("A", b) if a is None else ("B", a)
        return [f"log {ended} has ended; the other has step {other['step']} ({other['kind']})"]
    lines = []
    for name in differing(a, b):
        if name == "requests":
            lines.extend(_requests(a["requests"], b["requests"]))
        elif name in ("retracted", "finished", "aborted"):
            only_a = [r for r in a[name] if r not in b[name]]
            only_b = [r for r in b[name] if r not in a[name]]
            lines.append(f"{name}: only in A {_short(only_a)}, only in B {_short(only_b)}"
                         if only_a or only_b else f"{name}: same requests, other order")
        else:
            lines.append(f"{name}: A {a[name]!r}, B {b[name]!r}")
    return lines


def _requests(a: list[dict], b: list[dict]) -> list[str]:
    rids_a, rids_b = [e["rid"] for e in a], [e["rid"] for e in b]
    lines = []
    if rids_a != rids_b:
        only_a = [r for r in rids_a if r not in set(rids_b)]
        only_b = [r for r in rids_b if r not in set(rids_a)]
        lines.append(f"requests: A computes {len(a)}, B {len(b)}; only in A {_short(only_a)}, only in B {_short(only_b)}"
                     if only_a or only_b else "requests: the same requests in another order")
    by_rid = {e["rid"]: e for e in b}
    changed = [(e, by_rid[e["rid"]]) for e in a if e["rid"] in by_rid and e != by_rid[e["rid"]]]
    for x, y in changed[:8]:
        lines.append(f"request {x['rid']}: cached {x['cached']} / {y['cached']}, new {x['new']} / {y['new']} (A / B)")
    if len(changed) > 8:
        lines.append(f"... and {len(changed) - 8} more requests with other cached or new tokens")
    return lines


def _short(rids: list[str], keep: int = 8) -> str:
    text = ", ".join(rids[:keep]) or "none"
    return f"{text} (+{len(rids) - keep} more)" if len(rids) > keep else text
