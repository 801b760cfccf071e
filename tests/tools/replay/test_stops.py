"""A replay that stops early: Ctrl-C (exit 130, one line, a partial JSON document marked
interrupted) and the scheduler's progress guard (exit 1, the message naming the state)."""

import json

from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.errors import StalledError
from memcli.sched.scheduler import Scheduler
from tests.tools.replay.helpers import CONVERSATION

ARGS = ["replay", str(CONVERSATION), "--limit", "20", "--set", "memory.max_total_tokens=400000",
        "--set", "runtime.device=cpu"]


def _stop_at(monkeypatch, step: int, exc: BaseException) -> None:
    real = Scheduler.step

    def step_then_stop(self):
        if self.step_count == step:
            raise exc
        return real(self)

    monkeypatch.setattr(Scheduler, "step", step_then_stop)


def test_ctrl_c_prints_one_line_and_a_partial_document(monkeypatch):
    _stop_at(monkeypatch, 7, KeyboardInterrupt())
    result = CliRunner().invoke(app, [*ARGS, "--json"])
    assert result.exit_code == 130
    (line,) = result.stderr.splitlines()
    assert line.startswith("interrupted at request ") and " of 20, step 7 (simulated " in line
    doc = json.loads(result.stdout)
    assert doc["interrupted"] is True and doc["summary"]["steps"] == 7 and doc["requests"] == 20


def test_a_stall_exits_1_naming_step_clock_and_state(monkeypatch):
    _stop_at(monkeypatch, 3, StalledError("scheduler stalled at step 3, clock 12.000 ms: no request made progress"))
    result = CliRunner().invoke(app, [*ARGS, "--json"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: scheduler stalled at step 3, clock 12.000 ms") and "hint: " in result.stderr
    doc = json.loads(result.stdout)
    assert doc["interrupted"] is False and doc["stalled"].startswith("scheduler stalled at step 3")


def test_a_complete_replay_is_not_marked():
    result = CliRunner().invoke(app, [*ARGS, "--json", "--limit", "3"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["interrupted"] is False and doc["stalled"] is None
