"""One row per request of a replay, on the simulated clock: when it arrived, was admitted and
finished, how long it queued, its tokens, retractions and whether it was aborted
(`replay --requests-out FILE.csv|FILE.jsonl`), and the queueing-delay distribution.

    queueing delay = admission - arrival, where admission is the step that first prefilled
    the request (its first chunk); requests never admitted have none.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from memcli.errors import MemcliError

FORMATS = (".csv", ".jsonl")
COLUMNS = ("rid", "arrival_ms", "admission_ms", "finish_ms", "queueing_delay_ms", "input_tokens", "output_tokens",
           "cached_tokens", "retractions", "aborted")
QUEUEING_DELAY = ("queueing delay = admission - arrival on the simulated clock; admission is the step that first"
                  " prefilled the request (its first chunk); requests never admitted are not counted")


class RequestLog:
    """Per request in trace order, filled as requests leave the scheduler (NaN / -1: not yet)."""

    def __init__(self, num_requests: int, arrivals_ms: np.ndarray):
        self.arrival_ms = arrivals_ms.astype(np.float64, copy=True)
        self.cached_tokens = np.full(num_requests, -1, dtype=np.int64)  # matched at first admission
        self.admission_ms = np.full(num_requests, np.nan)
        self.finish_ms = np.full(num_requests, np.nan)
        self.output_tokens = np.zeros(num_requests, dtype=np.int64)
        self.retractions = np.zeros(num_requests, dtype=np.int64)
        self.aborted = np.zeros(num_requests, dtype=bool)

    def record(self, index: int, req) -> None:
        """What `req` (a scheduler `Req`) carries now; called when it finishes, or when the replay stops."""
        self.arrival_ms[index] = req.arrival_ms
        if req.first_cached_tokens is not None:
            self.cached_tokens[index] = req.first_cached_tokens
        self.admission_ms[index] = np.nan if req.admit_ms is None else req.admit_ms
        self.finish_ms[index] = np.nan if not req.finished or req.finish_ms is None else req.finish_ms
        self.output_tokens[index] = len(req.output_ids)
        self.retractions[index] = req.retraction_count
        self.aborted[index] = req.aborted

    @property
    def queueing_delay_ms(self) -> np.ndarray:
        return self.admission_ms - self.arrival_ms


@dataclass(frozen=True)
class DelayStats:
    """Queueing delay (ms) over the admitted requests: percentiles and the maximum."""

    requests: int
    p50: float
    p90: float
    p99: float
    max: float

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "p50": round(self.p50, 3), "p90": round(self.p90, 3),
                "p99": round(self.p99, 3), "max": round(self.max, 3), "definition": QUEUEING_DELAY}


def delay_stats(log: RequestLog) -> DelayStats:
    delays = log.queueing_delay_ms
    delays = delays[~np.isnan(delays)]
    if not len(delays):
        return DelayStats(0, 0.0, 0.0, 0.0, 0.0)
    p50, p90, p99 = np.percentile(delays, [50, 90, 99])
    return DelayStats(len(delays), float(p50), float(p90), float(p99), float(delays.max()))


def check_requests_out(path: Path) -> None:
    """Raise `MemcliError` (before the replay runs) for a path that cannot be written as a table."""
    if path.suffix not in FORMATS:
        raise MemcliError(f"--requests-out {path}: unknown format {path.suffix or '(no suffix)'!r}",
                          "name the file .csv (a table) or .jsonl (one JSON object per request)")
    if path.is_dir() or not path.parent.is_dir():
        raise MemcliError(f"--requests-out {path}: cannot write there",
                          "give a file path in an existing folder (an existing file is replaced)")


def rows(log: RequestLog, trace) -> Iterator[dict[str, Any]]:
    """One dict per request in trace order, the columns of `COLUMNS` (None: did not happen)."""
    cached = log.cached_tokens
    for i, spec in enumerate(trace.requests):
        yield {
            "rid": spec.rid,
            "arrival_ms": _ms(log.arrival_ms[i]),
            "admission_ms": _ms(log.admission_ms[i]),
            "finish_ms": _ms(log.finish_ms[i]),
            "queueing_delay_ms": _ms(log.queueing_delay_ms[i]),
            "input_tokens": spec.input_len,
            "output_tokens": int(log.output_tokens[i]),
            "cached_tokens": int(cached[i]) if cached[i] >= 0 else None,
            "retractions": int(log.retractions[i]),
            "aborted": bool(log.aborted[i]),
        }


def write_requests(path: Path, log: RequestLog, trace) -> int:
    """Write one row per request to `path` (.csv or .jsonl); returns the rows written."""
    count = 0
    try:
        with path.open("w", encoding="utf-8", newline="") as fh:
            if path.suffix == ".csv":
                writer = csv.DictWriter(fh, fieldnames=COLUMNS)
                writer.writeheader()
                for row in rows(log, trace):
                    writer.writerow({k: _cell(v) for k, v in row.items()})
                    count += 1
            else:
                for row in rows(log, trace):
                    fh.write(json.dumps(row, separators=(",", ":")) + "\n")
                    count += 1
    except OSError as exc:
        raise MemcliError(f"cannot write {path}: {exc.strerror}", "check that the folder is writable") from None
    return count


def _cell(value: Any) -> Any:
    """A CSV cell: empty for None, true/false as in the JSON lines."""
    if value is None:
        return ""
    return str(value).lower() if isinstance(value, bool) else value


def _ms(value: float):
    return None if math.isnan(value) else round(float(value), 3)
