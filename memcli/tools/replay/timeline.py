"""The timeline of a replay in the Chrome trace-event format (`replay --timeline FILE.json`),
which ui.perfetto.dev and chrome://tracing open. Times are the simulated clock, in µs.

    pid 1, tid 1   "steps": one B/E slice per step, named by its kind, args: step, batch size,
                   new and cached tokens
    pid 1          counters "pool tokens" (used, evictable, protected, free after each step) and,
                   with the host tier, "host tier tokens" (host_used)
    pid 1, tid 2   "evictions": an instant event per step that evicted (args: tokens)
    pid 2          one async slice per request (cat "request", id = rid): "request RID" from its
                   arrival to its finish, holding "queued" (arrival or retraction to admission)
                   and "running" (admission to retraction or finish) slices; a retraction is an
                   async instant "retracted", an abort ends the request with args aborted: true

Built from the step log's `LogStep`s (so every engine has one) and the arrivals the replay feeds.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from memcli.tools.replay.steplog import LogStep

STEPS_PID, REQUESTS_PID = 1, 2
STEPS_TID, EVICTIONS_TID = 1, 2


def _us(ms: float) -> float:
    return round(ms * 1000.0, 3)


class Timeline:
    """Collects the trace events of one replay; `document()` is the JSON object to write."""

    def __init__(self, host: bool = False):
        self.events: list[dict[str, Any]] = [
            _meta("process_name", STEPS_PID, 0, "memcli replay (simulated clock)"),
            _meta("thread_name", STEPS_PID, STEPS_TID, "steps"),
            _meta("thread_name", STEPS_PID, EVICTIONS_TID, "evictions"),
            _meta("process_name", REQUESTS_PID, 0, "requests"),
        ]
        self.host = host
        self.state: dict[str, str] = {}  # rid -> "queued" | "running" (open requests only)
        self.last_us = 0.0

    def arrived(self, rid: str, arrival_ms: float) -> None:
        ts = _us(arrival_ms)
        self._async("b", f"request {rid}", rid, ts)
        self._async("b", "queued", rid, ts)
        self.state[rid] = "queued"

    def step(self, s: LogStep) -> None:
        start, end = _us(s.t_ms), _us(s.end_ms)
        batch = s.batch
        self.events.append({"ph": "B", "name": s.kind, "ts": start, "pid": STEPS_PID, "tid": STEPS_TID,
                            "args": {"step": s.step, "batch_size": len(batch.rids), "new_tokens": sum(batch.new),
                                     "cached_tokens": sum(batch.cached)}})
        self.events.append({"ph": "E", "ts": end, "pid": STEPS_PID, "tid": STEPS_TID})
        self._counters(s, end)
        if s.evicted_tokens:
            self.events.append({"ph": "i", "s": "t", "name": "evict", "ts": start, "pid": STEPS_PID,
                                "tid": EVICTIONS_TID, "args": {"step": s.step, "tokens": s.evicted_tokens}})
        for rid, cached in zip(batch.rids, batch.cached):
            if self.state.get(rid) == "queued":
                self._async("e", "queued", rid, start)
                self._async("b", "running", rid, start, {"cached": cached})
                self.state[rid] = "running"
        for rid in s.retracted:
            if self.state.get(rid) == "running":
                self._async("e", "running", rid, start)
                self._async("n", "retracted", rid, start, {"step": s.step})
                self._async("b", "queued", rid, start)
                self.state[rid] = "queued"
        for rid in s.finished:
            self._end(rid, end, False)
        for rid in s.aborted:
            self._end(rid, end, True)
        self.last_us = max(self.last_us, end)

    def _counters(self, s: LogStep, ts: float) -> None:
        self.events.append({"ph": "C", "name": "pool tokens", "ts": ts, "pid": STEPS_PID, "tid": 0,
                            "args": {"used": s.used, "evictable": s.evictable, "protected": s.protected,
                                     "free": s.free}})
        if self.host and s.host_used is not None:
            self.events.append({"ph": "C", "name": "host tier tokens", "ts": ts, "pid": STEPS_PID, "tid": 0,
                                "args": {"host_used": s.host_used}})

    def _end(self, rid: str, ts: float, aborted: bool) -> None:
        phase = self.state.pop(rid, None)
        if phase is None:
            return
        self._async("e", phase, rid, ts)
        self._async("e", f"request {rid}", rid, ts, {"aborted": aborted})

    def _async(self, ph: str, name: str, rid: str, ts: float, args: Optional[dict] = None) -> None:
        event = {"ph": ph, "cat": "request", "name": name, "id": rid, "ts": ts, "pid": REQUESTS_PID, "tid": 0}
        if args is not None:
            event["args"] = args
        self.events.append(event)

    def document(self) -> dict[str, Any]:
        """The trace; requests still open (a replay that stopped early) end at the last step."""
        for rid in list(self.state):
            phase = self.state.pop(rid)
            self._async("e", phase, rid, self.last_us)
            self._async("e", f"request {rid}", rid, self.last_us, {"unfinished": True})
        return {"traceEvents": self.events, "displayTimeUnit": "ms",
                "otherData": {"clock": "simulated", "ts_unit": "us"}}

    def write(self, fh) -> None:
        json.dump(self.document(), fh, separators=(",", ":"))
        fh.write("\n")


def _meta(name: str, pid: int, tid: int, value: str) -> dict[str, Any]:
    return {"ph": "M", "name": name, "ts": 0, "pid": pid, "tid": tid, "args": {"name": value}}
