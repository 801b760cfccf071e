"""The progress guard: a scheduler that stops advancing raises `StalledError` with the state."""

import math

import pytest

from tests.sched.helpers import scheduler_for
from memcli.config import load_config
from memcli.errors import StalledError
from memcli.sched.progress import ProgressGuard
from memcli.sched.scheduler import Scheduler
from memcli.stack import build_stack


def _scheduler(max_stalled_steps: int = 1000) -> Scheduler:
    cfg = load_config(None, ["memory.kv_pool=indices", "runtime.device=cpu", "semantics.event_loop=normal"])
    sched = scheduler_for(build_stack(cfg), cfg, page_size=cfg.page_size)
    sched.progress_guard = ProgressGuard(max_stalled_steps)
    sched.add_request(sched.new_req("r0", list(range(1, 65)), 8))
    return sched


def test_a_clock_that_is_not_finite_stops_at_once(monkeypatch):
    sched = _scheduler()
    monkeypatch.setattr(sched, "prefill_cost_ms", lambda batch: math.nan)
    with pytest.raises(StalledError) as info:
        sched.step()
    msg = str(info.value)
    assert msg.startswith("scheduler stalled at step 0, clock nan ms: the simulated clock went from 0.0 to nan ms")
    assert "waiting 0, running 1, chunked 0, not yet arrived 0; free " in msg and "evictable 0" in msg


def test_no_progress_for_the_bound_stops_with_the_state(monkeypatch):
    sched = _scheduler(max_stalled_steps=5)
    sched.step()  # the prefill: progress
    monkeypatch.setattr(sched, "update_running_batch", lambda: None)  # decode never advances
    for _ in range(4):
        sched.step()
    with pytest.raises(StalledError, match=r"at step 5, clock [\d.]+ ms: no request made progress in 5 steps;"
                                           r" waiting 0, running 1, chunked 0"):
        sched.step()


def test_a_normal_run_never_trips_the_guard():
    sched = _scheduler(max_stalled_steps=2)
    sched.run()
    assert sched.is_done() and sched.stats.finished == 1


def test_the_overlap_loop_is_guarded_too(monkeypatch):
    cfg = load_config(None, ["memory.kv_pool=indices", "runtime.device=cpu", "semantics.event_loop=overlap"])
    sched = scheduler_for(build_stack(cfg), cfg, page_size=cfg.page_size)
    sched.add_request(sched.new_req("r0", list(range(1, 65)), 8))
    monkeypatch.setattr(sched, "prefill_cost_ms", lambda batch: math.nan)
    with pytest.raises(StalledError, match="clock went from 0.0 to nan ms"):
        sched.run(max_steps=10)
