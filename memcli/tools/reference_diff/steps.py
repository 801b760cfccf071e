"""Both sides' step logs of a `reference diff` run, built from the harness's observations the
same way on both sides (`steplog.from_observation`), written when asked and compared in the
shape of `memcli diff`."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Optional

from memcli.tools.diff.compare import LogDiff, compare_logs
from memcli.tools.replay.steplog import Admissions, StepLogWriter, from_observation, open_output


class SideLog:
    """One side's log, kept in memory (a reference diff runs short traces)."""

    def __init__(self, pool_tokens: int, host: bool):
        self.text = io.StringIO()
        self.writer = StepLogWriter(self.text)
        self.admissions = Admissions()
        self.pool_tokens, self.host = pool_tokens, host
        self.start_ms = 0.0

    def add(self, obs) -> None:
        self.writer.write(from_observation(obs, self.start_ms, self.pool_tokens, self.admissions, self.host))
        self.start_ms = obs.clock_ms

    def steps(self) -> list[dict]:
        return [json.loads(line) for line in self.text.getvalue().splitlines()]


class BothLogs:
    """`on_step(sglang, memcli)` for the side-by-side run; `save` writes the files asked for."""

    def __init__(self, pool_tokens: int, host: bool):
        self.reference, self.memcli = SideLog(pool_tokens, host), SideLog(pool_tokens, host)

    def on_step(self, reference_obs, memcli_obs) -> None:
        self.reference.add(reference_obs)
        self.memcli.add(memcli_obs)

    def save(self, memcli_path: Optional[Path], reference_path: Optional[Path]) -> None:
        for side, path, option in ((self.memcli, memcli_path, "--steps-out"),
                                   (self.reference, reference_path, "--reference-steps-out")):
            if path is not None:
                with open_output(path, option) as fh:
                    fh.write(side.text.getvalue())

    def compare(self) -> LogDiff:
        """A: the engine's own code; B: memcli."""
        return compare_logs(self.reference.steps(), self.memcli.steps())
