"""The replay benchmark (`python -m memcli.tools.replay.bench`): its figures are the replays'
own (steps and hits of `memcli replay`, rates from the median round), and bad input exits 2."""

from __future__ import annotations

import json

from memcli.config import load_config
from memcli.tools.replay.bench import main, run_bench
from memcli.tools.replay.runner import ReplayOptions, replay
from memcli.workload.readers import read_trace
from tests.tools.replay.helpers import CONVERSATION

POINT = "memory.max_total_tokens=200000 memory.max_running_requests=16 memory.max_context_len=65536"


def test_bench_rows_are_the_replays_steps_and_hits():
    points = [POINT, POINT + " memory.page_size=16"]
    rows = run_bench(CONVERSATION, points, "sglang-0.5.23", limit=30, rounds=2)
    trace = read_trace(CONVERSATION, limit=30)
    for point, row in zip(points, rows):
        config = load_config(None, [*point.split(), "semantics.engine=sglang-0.5.23"], builtin="replay")
        result = replay(config, trace, ReplayOptions("timestamp"))
        assert (row.requests, row.steps, row.cached_tokens) == (30, result.summary.steps,
                                                                 int(result.first_cached_tokens.sum()))
        assert len(row.rounds_s) == 2 and min(row.rounds_s) <= row.replay_s <= max(row.rounds_s)
        assert abs(row.steps_per_s - row.steps / row.replay_s) <= 1e-6 * row.steps_per_s
        assert abs(row.requests_per_s - 30 / row.replay_s) <= 1e-6 * row.requests_per_s


def test_bench_json_and_bad_input(capsys):
    assert main([str(CONVERSATION), "--limit", "10", "--point", POINT, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["engine"] == "sglang-0.5.23" and doc["machine"]["cpus"] >= 1
    assert [p["point"] for p in doc["points"]] == [POINT] and doc["points"][0]["requests"] == 10
    assert main([str(CONVERSATION), "--limit", "10", "--point", "memory.page_size=3"]) == 2
    assert "error: memory.page_size" in capsys.readouterr().err
    assert main([str(CONVERSATION), "--rounds", "0"]) == 2


def test_step_times_count_every_step_by_kind_and_cover_the_loop():
    trace = read_trace(CONVERSATION, limit=30)
    config = load_config(None, [*POINT.split(), "semantics.engine=sglang-0.5.23"], builtin="replay")
    plain = replay(config, trace, ReplayOptions("timestamp"))
    timed = replay(config, trace, ReplayOptions("timestamp", step_times=True))
    assert plain.step_times is None
    times = timed.step_times
    summary = timed.summary
    steps = times.steps
    assert sum(steps.values()) == summary.steps
    assert steps["prefill"] == summary.prefill_steps and steps["idle"] == summary.idle_steps
    assert steps["finishing"] + steps["decode"] == summary.decode_steps
    assert 0 < steps["finishing"] <= summary.finished  # a step finishing several counts once
    assert 0 <= times.between_s and sum(times.seconds.values()) + times.between_s <= times.loop_s + 1e-9
    assert times.loop_s <= summary.wall_s
    doc = times.to_dict()
    assert doc["kinds"]["prefill"]["steps"] == steps["prefill"]
    assert doc["kinds"]["decode"]["us_per_step"] == round(times.per_step_us("decode"), 1)
    # timing the steps changes nothing the replay reports
    assert timed.summary.steps == plain.summary.steps
    assert (timed.first_cached_tokens == plain.first_cached_tokens).all()


def test_bench_prints_where_the_time_goes(capsys):
    assert main([str(CONVERSATION), "--limit", "10", "--point", POINT]) == 0
    out = capsys.readouterr().out
    assert "where the replay time goes" in out and "between steps" in out and "outside the loop" in out
    rows = run_bench(CONVERSATION, [POINT], "sglang-0.5.23", limit=10, rounds=3)
    split = rows[0].step_times
    assert sum(k["steps"] for k in split["kinds"].values()) == rows[0].steps
    assert split["loop_wall_s"] <= max(rows[0].rounds_s)


def test_bench_check_replays_each_point_under_the_incremental_check(capsys):
    rows = run_bench(CONVERSATION, [POINT], "sglang-0.5.23", limit=30, rounds=2, plain=False, check=True)
    row = rows[0]
    assert row.plain_s is None and len(row.checked_rounds_s) == 2
    assert min(row.checked_rounds_s) <= row.checked_s <= max(row.checked_rounds_s)
    assert row.check_cost == row.checked_s / row.replay_s
    assert main([str(CONVERSATION), "--limit", "10", "--point", POINT, "--check", "--no-plain"]) == 0
    out = capsys.readouterr().out
    assert "checked s" in out and "check x = checked s / replay s" in out and "plain s" not in out


def test_bench_stops_when_a_checked_replay_fails(capsys, monkeypatch):
    from memcli.mem_cache.integrity import checker

    def fails(self, step, running, run=None):
        raise self._failure(step, checker.failed("free_list", "a planted failure"), running, run)

    monkeypatch.setattr(checker.IntegrityChecker, "_incremental", fails)
    assert main([str(CONVERSATION), "--limit", "10", "--point", POINT, "--check", "--no-plain"]) == 2
    assert "did not finish cleanly" in capsys.readouterr().err


def test_bench_times_the_floor_of_the_array_work_in_each_round(capsys):
    rows = run_bench(CONVERSATION, [POINT, POINT + " memory.page_size=16"], "sglang-0.5.23", limit=20, rounds=2,
                     plain=False)
    assert len(rows[0].floor_rounds_s) == 2 and rows[0].floor_rounds_s == rows[1].floor_rounds_s  # one per round
    assert min(rows[0].floor_rounds_s) <= rows[0].floor_s <= max(rows[0].floor_rounds_s)
    assert rows[1].over_floor == rows[1].replay_s / rows[1].floor_s
    no_floor = run_bench(CONVERSATION, [POINT], "sglang-0.5.23", limit=20, plain=False, floor=False)[0]
    assert no_floor.floor_s is None and no_floor.over_floor is None and no_floor.floor_rounds_s == ()
    assert main([str(CONVERSATION), "--limit", "10", "--point", POINT, "--no-plain"]) == 0
    out = capsys.readouterr().out
    assert "floor: the trace's array work alone" in out and out.split("replay s over it: ")[1].startswith(f"{POINT} ")
    assert main([str(CONVERSATION), "--limit", "10", "--point", POINT, "--no-plain", "--no-floor", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["points"][0]["floor_s"] is None and doc["points"][0]["over_floor"] is None


def test_default_points_are_the_ones_the_engine_runs(capsys):
    """vLLM 0.33 has no host tier, and reads page size 1 as its block size 16: its default
    points leave hiradix and page size 16 out, say so on stderr and in the JSON, and the bench
    runs the rest; an explicit point it cannot run is bad input."""
    from memcli.tools.replay.bench import DEFAULT_POINTS, default_points

    assert default_points("sglang-0.5.23") == (list(DEFAULT_POINTS), [])
    points, skipped = default_points("vllm-0.33")
    assert points == ["memory.page_size=1"]
    assert [p for p, _ in skipped] == ["memory.page_size=16", "memory.page_size=1 cache.kind=hiradix"]
    assert "same config as 'memory.page_size=1'" in skipped[0][1] and "host tier" in skipped[1][1]
    args = [str(CONVERSATION), "--engine", "vllm-0.33", "--limit", "8", "--no-plain", "--no-floor", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert [p["point"] for p in doc["points"]] == points and doc["points"][0]["requests"] == 8
    assert [p["point"] for p in doc["left_out"]] == [p for p, _ in skipped]
    assert "left out" in captured.err and "hiradix" in captured.err
    assert main([*args[:-1], "--point", "cache.kind=hiradix"]) == 2
    assert "host tier" in capsys.readouterr().err
