"""What a replay writes step by step when asked: the step log (`--steps-out`) and the timeline
(`--timeline`). Both are built from the scheduler's step records and events (`memcli.steps`),
so they come the same way from every engine."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional

from memcli.tools.replay.steplog import StepLogWriter, from_record, open_output
from memcli.tools.replay.timeline import Timeline


class Instruments:
    """Fed by the replay: `arrived` for each request handed to the scheduler, `step` after each
    step with its record and events. The timeline is written by `close`."""

    def __init__(self, steps_fh, timeline_fh, pool_tokens: int, host: bool):
        self.log = StepLogWriter(steps_fh) if steps_fh is not None else None
        self.timeline = Timeline(host) if timeline_fh is not None else None
        self.timeline_fh = timeline_fh
        self.pool_tokens, self.host = pool_tokens, host
        self.start_ms = 0.0

    def arrived(self, rid: str, arrival_ms: float) -> None:
        if self.timeline is not None:
            self.timeline.arrived(rid, arrival_ms)

    def step(self, record, events) -> None:
        s = from_record(record, events, self.start_ms, self.pool_tokens, self.host)
        self.start_ms = record.time_ms
        if self.log is not None:
            self.log.write(s)
        if self.timeline is not None:
            self.timeline.step(s)

    def close(self) -> None:
        if self.timeline is not None:
            self.timeline.write(self.timeline_fh)


@contextlib.contextmanager
def opened(steps_path: Optional[Path], timeline_path: Optional[Path]) -> Iterator[tuple]:
    """The two files (None where not asked), open for writing; `MemcliError` when one cannot be."""
    with contextlib.ExitStack() as stack:
        files = tuple(None if path is None else stack.enter_context(open_output(path, option))
                      for path, option in ((steps_path, "--steps-out"), (timeline_path, "--timeline")))
        yield files
