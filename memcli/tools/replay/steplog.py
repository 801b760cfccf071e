"""The step log: one JSON object per scheduler step (`replay --steps-out`, `reference diff
--steps-out`), the same for every engine (docs/JSON.md, "The step log").

    {"step": 0, "t_ms": 0.0, "kind": "prefill", "requests": [{"rid": "1", "cached": 512, "new": 6246}],
     "retracted": [], "finished": [], "aborted": [], "evicted_tokens": 0,
     "used": 6758, "evictable": 0, "protected": 0, "free": 4187546}

A `LogStep` is built from what every engine reports (`memcli.steps`: the `StepRecord` with its
batch, and the step's events), or from the reference harness's `StepObservation`s; `dumps`
writes it, `read_log` reads a file back, refusing a malformed line with its file and line.
`t_ms` is the simulated clock when the step began; the sizes are tokens after the step, and
`used + evictable + protected + free` is the pool.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple, Optional

from memcli.errors import MemcliError
from memcli.steps import NO_BATCH, StepBatch

KINDS = ("prefill", "decode", "mixed", "idle")
SIZES = ("used", "evictable", "protected", "free")
# The fields of every line, in order; `engine` ({...}) may follow with an engine's own fields.
FIELDS = ("step", "t_ms", "kind", "requests", "retracted", "finished", "aborted", "evicted_tokens", *SIZES)


class LogStep(NamedTuple):
    """One step of the log. `end_ms` (the clock after the step) and `host_used` (the host tier's
    slots, None without one) are for the timeline; the log writes `host_used` under `engine`."""

    step: int
    t_ms: float
    end_ms: float
    kind: str
    batch: StepBatch
    retracted: tuple[str, ...]
    finished: tuple[str, ...]
    aborted: tuple[str, ...]
    evicted_tokens: int
    used: int
    evictable: int
    protected: int
    free: int
    host_used: Optional[int] = None


def from_record(record, events: Iterable, start_ms: float, pool_tokens: int, host: bool = False) -> LogStep:
    """The log step of a `StepRecord` (with its `batch`) and the `Event`s of that step."""
    retracted, finished, aborted, evicted = [], [], [], 0
    for event in events:
        kind = event.kind
        if kind == "finish":
            finished.append(event.rid)
        elif kind == "abort":
            aborted.append(event.rid)
        elif kind == "retract":
            retracted.append(event.rid)
        elif kind == "evict":
            evicted += event.tokens
    free, evictable, protected = record.available, record.evictable, record.protected
    return LogStep(record.step, start_ms, record.time_ms, record.kind, record.batch or NO_BATCH, tuple(retracted),
                   tuple(finished), tuple(aborted), evicted, pool_tokens - free - evictable - protected, evictable,
                   protected, free, record.host_used if host else None)


class Admissions:
    """Which requests are in service (admitted, not yet retracted or finished), to tell an
    admission from a later chunk when only the batches are known (the reference harness)."""

    def __init__(self):
        self.serving: set[str] = set()

    def batch(self, rids: tuple[str, ...], prefix_lens: tuple[int, ...], extend_lens: tuple[int, ...]) -> StepBatch:
        """A prefill batch (`extend_lens` given) or a decode (empty `extend_lens`)."""
        if not extend_lens:
            return StepBatch(tuple(rids), (0,) * len(rids), (1,) * len(rids))
        cached = []
        for rid, prefix in zip(rids, prefix_lens):
            cached.append(0 if rid in self.serving else int(prefix))
            self.serving.add(rid)
        return StepBatch(tuple(rids), tuple(cached), tuple(int(n) for n in extend_lens))

    def left(self, rids: Iterable[str]) -> None:
        self.serving.difference_update(rids)


def from_observation(obs, start_ms: float, pool_tokens: int, admissions: Admissions, host: bool = False) -> LogStep:
    """The log step of a reference harness's `StepObservation` (`memcli.reference.observe`).
    Observations do not tell an abort from a finish: both are `finished`."""
    batch = admissions.batch(obs.rids, obs.prefix_lens, obs.extend_lens) if obs.kind in ("prefill", "decode") \
        else NO_BATCH
    admissions.left(obs.retracted)
    admissions.left(obs.finished)
    kind = obs.kind if obs.kind in KINDS else "idle"  # "done": a side that has finished
    free, evictable, protected = obs.available, obs.evictable, obs.protected
    return LogStep(obs.step, start_ms, obs.clock_ms, kind, batch, tuple(obs.retracted), tuple(obs.finished), (),
                   obs.evicted, pool_tokens - free - evictable - protected, evictable, protected, free,
                   obs.host_used if host else None)


class StepLogWriter:
    """Writes `LogStep`s as JSON lines to an open text file. Decode entries are cached per
    request (most lines are decodes), which keeps a long run's log cheap."""

    def __init__(self, fh):
        self.fh = fh
        self._rid: dict[str, str] = {}
        self._decode: dict[str, str] = {}

    def _rid_json(self, rid: str) -> str:
        text = self._rid.get(rid)
        if text is None:
            text = self._rid[rid] = json.dumps(rid)
        return text

    def _requests(self, batch: StepBatch) -> str:
        parts = []
        decode = self._decode
        for rid, cached, new in zip(batch.rids, batch.cached, batch.new):
            if cached == 0 and new == 1:
                text = decode.get(rid)
                if text is None:
                    text = decode[rid] = f'{{"rid":{self._rid_json(rid)},"cached":0,"new":1}}'
            else:
                text = f'{{"rid":{self._rid_json(rid)},"cached":{cached},"new":{new}}}'
            parts.append(text)
        return ",".join(parts)

    def _rids(self, rids: tuple[str, ...]) -> str:
        return ",".join(self._rid_json(rid) for rid in rids) if rids else ""

    def write(self, s: LogStep) -> None:
        engine = "" if s.host_used is None else f',"engine":{{"host_used":{s.host_used}}}'
        self.fh.write(
            f'{{"step":{s.step},"t_ms":{round(s.t_ms, 3)!r},"kind":"{s.kind}","requests":[{self._requests(s.batch)}],'
            f'"retracted":[{self._rids(s.retracted)}],"finished":[{self._rids(s.finished)}],'
            f'"aborted":[{self._rids(s.aborted)}],"evicted_tokens":{s.evicted_tokens},"used":{s.used},'
            f'"evictable":{s.evictable},"protected":{s.protected},"free":{s.free}{engine}}}\n')


def open_output(path: Path, option: str):
    """`path` opened for writing, or `MemcliError` (exit 2) naming the option."""
    if path.is_dir() or not path.parent.is_dir():
        raise MemcliError(f"{option} {path}: cannot write there",
                          "give a file path in an existing folder (an existing file is replaced)")
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise MemcliError(f"{option} {path}: cannot write: {exc.strerror}", "check that the folder is writable") from None


# -- reading ---------------------------------------------------------------------------------
def read_log(path: Path) -> Iterator[dict[str, Any]]:
    """The steps of a log file, one dict per line, each checked against the schema; a file
    that cannot be read or a malformed line is a `MemcliError` naming the file and the line."""
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise MemcliError(f"{path}: cannot read the step log: {exc.strerror}",
                          "give a file written by replay --steps-out or reference diff --steps-out") from None
    with fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                yield check_line(path, number, line)


def check_line(path: Path, number: int, line: str) -> dict[str, Any]:
    where = f"{path}:{number}"
    try:
        step = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _bad(where, f"not JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(step, dict):
        raise _bad(where, "not a JSON object")
    missing = [name for name in FIELDS if name not in step]
    if missing:
        raise _bad(where, f"missing {', '.join(missing)}")
    problem = _field_problem(step)
    if problem is not None:
        raise _bad(where, problem)
    return step


def _field_problem(step: dict[str, Any]) -> Optional[str]:
    def is_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)
    for name in ("step", "evicted_tokens", *SIZES):
        if not is_int(step[name]):
            return f"{name} is {step[name]!r}, not an integer"
    if not isinstance(step["t_ms"], (int, float)) or isinstance(step["t_ms"], bool):
        return f"t_ms is {step['t_ms']!r}, not a number"
    if step["kind"] not in KINDS:
        return f"kind is {step['kind']!r}, not one of {', '.join(KINDS)}"
    for name in ("retracted", "finished", "aborted"):
        if not isinstance(step[name], list) or not all(isinstance(rid, str) for rid in step[name]):
            return f"{name} is not a list of request ids"
    requests = step["requests"]
    if not isinstance(requests, list):
        return "requests is not a list"
    for entry in requests:
        if not (isinstance(entry, dict) and isinstance(entry.get("rid"), str) and is_int(entry.get("cached"))
                and is_int(entry.get("new"))):
            return f"requests holds {entry!r}, not {{rid: string, cached: int, new: int}}"
    return None


def _bad(where: str, what: str) -> MemcliError:
    return MemcliError(f"{where}: {what}", "a step log has one JSON object per line (docs/JSON.md, \"The step log\")")
