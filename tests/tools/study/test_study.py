"""Studies: every executor gives the same rows, files are written as points finish, --resume
skips what is there, and each page size gets its unlimited-pool reference."""

from __future__ import annotations

import csv
import importlib.util
import json
import pickle
import sys

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.config import apply_overrides, config_from_dict
from memcli.errors import CapacityError, MemcliError
from memcli.tools.study import plan as study_mod
from memcli.tools.study import unlimited as unlimited_mod
from memcli.tools.replay.ceiling import shared_prefix_lens
from memcli.tools.study.executors import processes, ray_executor, serial
from memcli.tools.study.grid import grid_points, parse_sweep
from memcli.tools.replay.runner import ReplayOptions
from memcli.tools.study.plan import StudyContext, StudyState, plan_study, run_tasks
from memcli.tools.study.results import TIMING_COLUMNS
from memcli.tools.study.unlimited import unlimited_pool_tokens
from memcli.workload.readers import read_trace

from tests.tools.replay.helpers import CONVERSATION, shrink_mooncake, small_config

runner = CliRunner()
SMALL = ["--set", "memory.max_total_tokens=60000", "--set", "memory.max_running_requests=16",
         "--set", "memory.max_context_len=60000", "--set", "runtime.device=cpu",
         "--set", "scheduler.chunked_prefill_size=4096", "--set", "scheduler.max_prefill_tokens=8192"]
GRID = ["--sweep", "memory.max_total_tokens=8000,60000", "--sweep", "cache.eviction_policy=lru,fifo",
        "--sweep", "memory.page_size=1,16"]


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    return shrink_mooncake(CONVERSATION, tmp_path_factory.mktemp("s") / "t.jsonl", 40, block_size=32)


@pytest.fixture(scope="module")
def trace(trace_path):
    return read_trace(trace_path, block_size=32)


def _make_config(extra):
    raw = small_config(16, pool=60_000, context=60_000).to_dict()
    return config_from_dict(apply_overrides(raw, extra))


def _study(trace, points, options=ReplayOptions("burst")):
    plan = plan_study(points, _make_config, trace, options)
    return StudyState(plan), StudyContext(trace, options, shared_prefix_lens(trace))


def _rows(state):
    """Rows by task, without the machine-dependent columns."""
    return {key: {k: v for k, v in row.items() if k not in TIMING_COLUMNS} for key, row in state.rows.items()}


@pytest.fixture(scope="module")
def serial_rows(trace):
    points = grid_points([parse_sweep("memory.max_total_tokens=8000,60000"), parse_sweep("cache.eviction_policy=lru,fifo"),
                          parse_sweep("memory.page_size=1,16")])
    state, context = _study(trace, points)
    return points, _rows(run_tasks(state, context, serial))


def test_a_study_is_every_point_plus_one_reference_per_page_size(serial_rows):
    points, rows = serial_rows
    assert len(rows) == 8 + 2
    small = [rows[k] for k in rows if k.startswith("point:") and '"memory.max_total_tokens": 8000' in k]
    assert len(small) == 4 and all(r["evictions"] > 0 and r["pool_tokens"] == 8000 for r in small)
    refs = [row for key, row in rows.items() if key.startswith("reference:")]
    assert sorted(ref["page_size"] for ref in refs) == [1, 16]
    # The policies differ where the pool is short: the study really ran each point's config.
    by_point = {k: r for k, r in rows.items() if k.startswith("point:")}
    assert {r["eviction_policy"] for r in by_point.values()} == {"lru", "fifo"}


def test_processes_give_the_same_rows_as_serial(trace, serial_rows):
    points, expected = serial_rows
    state, context = _study(trace, points)
    assert _rows(run_tasks(state, context, processes(2))) == expected


def test_tasks_sharing_the_trace_index_give_the_rows_of_tasks_alone(trace, serial_rows):
    """A process builds the trace's future index once (`StudyContext.kept`) and its later replays
    share it: every row equals that of the task replayed with a context of its own, and the
    context travels to a worker without what a process built."""
    points, expected = serial_rows
    state, context = _study(trace, points)
    alone = {}
    for task in state.plan.tasks:
        own = StudyContext(trace, context.options, context.shared)
        alone[task.key] = study_mod.run_task(task, own)
    shared_rows = {task.key: study_mod.run_task(task, context) for task in state.plan.tasks}
    strip = lambda rows: {k: {c: v for c, v in r.items() if c not in TIMING_COLUMNS} for k, r in rows.items()}  # noqa: E731
    assert strip(shared_rows) == strip(alone) == expected
    assert len(context.kept) == 1  # one index for the Mooncake trace, whatever the page size
    shipped = pickle.loads(pickle.dumps(context))
    assert shipped.kept == {} and (shipped.shared == context.shared).all()
    assert [r.hash_ids for r in shipped.trace.requests] == [r.hash_ids for r in trace.requests]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'memcli[ray]')")
def test_ray_gives_the_same_rows_as_serial(trace, serial_rows):
    points, expected = serial_rows
    state, context = _study(trace, points)
    assert _rows(run_tasks(state, context, ray_executor(None, 2))) == expected


def test_every_point_is_checked_before_the_first_replay(trace, monkeypatch):
    monkeypatch.setattr(study_mod, "replay", lambda *a, **k: pytest.fail("replayed before checking every point"))
    with pytest.raises(CapacityError):
        plan_study(grid_points([parse_sweep("memory.max_total_tokens=60000,2000")]), _make_config, trace,
                   ReplayOptions("burst", strict_limits=True))
    # Without --strict-limits the small point runs, its long prompts aborted as SGLang aborts them.
    plan = plan_study(grid_points([parse_sweep("memory.max_total_tokens=60000,2000")]), _make_config, trace,
                      ReplayOptions("burst"))
    assert [task.config.pool_size for task in plan.tasks if task.kind == "point"] == [60000, 2000]


def test_small_pool_points_name_the_requests_the_engine_aborts(trace):
    longest = max(spec.input_len for spec in trace.requests)
    pool = (longest // 1024) * 1024  # whole pages; the longest prompt is past its request limits
    state, context = _study(trace, grid_points([parse_sweep(f"memory.max_total_tokens={pool},60000")]))
    rows = run_tasks(state, context, serial).rows
    small, large = (next(row for key, row in rows.items() if key.startswith("point:") and row["pool_tokens"] == n)
                    for n in (pool, 60000))
    too_long = [(i, spec) for i, spec in enumerate(trace.requests) if spec.input_len >= pool - 1 - 5]
    assert too_long and small["limit_aborted"] == len(too_long) and small["limit_clipped"] >= 0
    for _, spec in too_long:
        assert f"{spec.rid} (line {spec.line}) aborted" in small["limit_cut_requests"]
    assert "limit_aborted" not in large and "limit_cut_requests" not in large


def test_reference_is_computed_when_the_pool_would_be_too_large(trace, monkeypatch):
    monkeypatch.setattr(unlimited_mod, "UNLIMITED_REPLAY_MAX_TOKENS", 1000)
    state, context = _study(trace, [{"cache.eviction_policy": "lru"}], ReplayOptions("sequential"))
    rows = run_tasks(state, context, serial).rows
    ref = next(row for key, row in rows.items() if key.startswith("reference:"))
    point = next(row for key, row in rows.items() if key.startswith("point:"))
    assert ref["method"] == "computed" and ref["pool_tokens"] is None
    # Sequential arrivals and no eviction at 60k tokens: the replay reaches the computed ceiling.
    assert ref["hit_rate"] == point["hit_rate"] == point["ceiling_hit_rate"]


def test_reference_replays_with_every_token_of_the_trace(trace):
    state, context = _study(trace, [{"memory.max_total_tokens": 12000}], ReplayOptions("sequential"))
    rows = run_tasks(state, context, serial).rows
    ref = next(row for key, row in rows.items() if key.startswith("reference:"))
    point = next(row for key, row in rows.items() if key.startswith("point:"))
    assert ref["method"] == "replayed" and ref["pool_tokens"] == unlimited_pool_tokens(trace, 16)
    assert ref["hit_rate"] == ref["ceiling_hit_rate"] >= point["hit_rate"]


# -- through the CLI: files, resume ---------------------------------------------------------


def invoke(*args):
    return runner.invoke(app, ["replay", *map(str, args)])


def test_out_writes_json_and_csv_and_resume_runs_only_what_is_missing(trace_path, tmp_path, monkeypatch):
    out = tmp_path / "study"
    first = invoke(trace_path, "--block-size", 32, *SMALL, *GRID, "--jobs", 1, "--out", out, "--json")
    assert first.exit_code == 0, first.stderr
    doc = json.loads(first.stdout)
    assert json.loads((out / "study.json").read_text()) == doc and doc["study"]["complete"]
    with open(out / "study.csv") as fh:
        table = list(csv.DictReader(fh))
    # 8 points, and the 4 belady twins a policy sweep always gets.
    assert len(table) == 12 and [row["cache.eviction_policy"] for row in table[8:]] == ["belady"] * 4
    assert list(table[0])[:4] == ["index", "memory.max_total_tokens", "cache.eviction_policy",
                                                      "memory.page_size"]
    assert [row["hit_rate"] for row in table] == [str(p["hit_rate"]) for p in doc["points"]]
    # Same folder again without --resume: refused, nothing run.
    again = invoke(trace_path, "--block-size", 32, *SMALL, *GRID, "--jobs", 1, "--out", out)
    assert again.exit_code == 2 and "already holds a study" in again.stderr and "--resume" in again.stderr
    # An interrupted study: two points and one reference missing. --resume runs those three only.
    partial = dict(doc, points=doc["points"][:3] + doc["points"][5:], references=doc["references"][:1])
    (out / "study.json").write_text(json.dumps(partial))
    ran = []
    real = study_mod.run_task
    monkeypatch.setattr(study_mod, "run_task", lambda task, context: ran.append(task.index) or real(task, context))
    from memcli.tools.study import executors
    monkeypatch.setattr(executors, "run_task", study_mod.run_task)
    resumed = invoke(trace_path, "--block-size", 32, *SMALL, *GRID, "--jobs", 1, "--out", out, "--resume", "--json")
    assert resumed.exit_code == 0, resumed.stderr
    assert sorted(ran) == [3, 4, 13]
    strip = lambda d: [{k: v for k, v in p.items() if k not in TIMING_COLUMNS} for p in d["points"]]  # noqa: E731
    assert strip(json.loads(resumed.stdout)) == strip(doc)


def test_resume_refuses_a_different_study(trace_path, tmp_path):
    out = tmp_path / "study"
    assert invoke(trace_path, "--block-size", 32, *SMALL, "--sweep", "cache.eviction_policy=lru", "--jobs", 1,
                  "--out", out).exit_code == 0
    other = invoke(trace_path, "--block-size", 32, *SMALL, "--set", "memory.max_running_requests=8",
                   "--sweep", "cache.eviction_policy=lru", "--jobs", 1, "--out", out, "--resume")
    assert other.exit_code == 2 and "is a study of something else (differs in: config)" in other.stderr


def test_ray_without_ray_installed_is_bad_input(trace_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    result = invoke(trace_path, "--block-size", 32, *SMALL, "--sweep", "cache.eviction_policy=lru", "--ray")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --ray needs Ray") and "pip install 'memcli[ray]'" in result.stderr


def test_a_sweep_file_study(trace_path, tmp_path):
    points = tmp_path / "points.yaml"
    points.write_text("- {memory.max_total_tokens: 8000, cache.eviction_policy: lru}\n- {memory.page_size: 1}\n")
    result = invoke(trace_path, "--block-size", 32, *SMALL, "--sweep-file", points, "--jobs", 1, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    # A point sets the policy: each point gets its belady twin.
    assert [p["config"] for p in doc["points"]] == [
        {"memory.max_total_tokens": 8000, "cache.eviction_policy": "lru", "memory.page_size": 1},
        {"memory.max_total_tokens": 60000, "cache.eviction_policy": "lru", "memory.page_size": 1},
        {"memory.max_total_tokens": 8000, "cache.eviction_policy": "belady", "memory.page_size": 1},
        {"memory.max_total_tokens": 60000, "cache.eviction_policy": "belady", "memory.page_size": 1}]


def test_every_rate_column_of_a_row_has_its_definition(serial_rows):
    from memcli.tools.study.files import RATE_COLUMNS

    _, rows = serial_rows
    row = next(r for k, r in rows.items() if k.startswith("point:"))
    rates = {column for column in row if column.endswith("hit_rate") or column == "block_ratio"}
    assert rates == set(RATE_COLUMNS)
    assert row["needed_again_share"] is not None and 0 <= row["needed_again_share"] <= 1


def test_ctrl_c_keeps_what_finished_and_exits_130(trace_path, tmp_path, monkeypatch):
    out = tmp_path / "study"
    real = study_mod.run_task

    def interrupted_at_the_third(task, context):
        if task.index == 2:
            raise KeyboardInterrupt
        return real(task, context)

    from memcli.tools.study import executors

    monkeypatch.setattr(executors, "run_task", interrupted_at_the_third)
    result = invoke(trace_path, "--block-size", 32, *SMALL, "--sweep", "memory.max_total_tokens=8000,20000,60000",
                    "--jobs", 1, "--out", out)
    assert result.exit_code == 130
    assert "interrupted: 2 of 4 replays finished; --resume --out" in result.stderr
    doc = json.loads((out / "study.json").read_text())
    assert [p["index"] for p in doc["points"]] == [0, 1] and not doc["study"]["complete"]


def test_the_small_pool_study_of_the_issue_runs_and_names_the_aborted_request():
    """synthetic_head200's request 190 (line 190) has a prompt of 82,831 tokens: past SGLang's
    request limits at a pool of 60,000 (aborted at arrival, as SGLang does), not at 120,000."""
    from tests.tools.replay.helpers import SYNTHETIC

    result = runner.invoke(app, ["replay", str(SYNTHETIC), "--limit", "190", "--jobs", "1", "--json",
                                 "--sweep", "memory.max_total_tokens=60000,120000",
                                 "--set", "memory.max_context_len=140000"])
    assert result.exit_code == 0, result.stderr
    points = {entry["pool_tokens"]: entry for entry in json.loads(result.stdout)["points"]}
    assert points[60000]["limit_cut_requests"] == "190 (line 190) aborted" and points[60000]["limit_aborted"] == 1
    assert "limit_cut_requests" not in points[120000]
    assert [line for line in result.stderr.splitlines() if line.startswith("warning:")] == [
        "warning: the engine's limits cut requests at 1 of 2 points; the report names them (--strict-limits"
        " refuses the trace instead)"]


# -- points the engine replays alike ----------------------------------------------------------


def _engine_config(engine):
    return lambda extra: _make_config([f"semantics.engine={engine}", *extra])


def _without(row, *keys):
    return {k: v for k, v in row.items() if k not in (*TIMING_COLUMNS, *keys)}


def test_a_point_the_engine_replays_as_another_is_replayed_once_and_says_so(trace, monkeypatch):
    """Under sglang-0.5.5 the radix tree counts no hits, so LFU evicts in LRU's order: each lfu
    point takes its lru twin's row. The row is checked against the lfu point replayed alone."""
    from memcli.tools.replay.runner import replay
    from memcli.tools.study import executors
    from memcli.tools.study.results import point_row

    points = grid_points([parse_sweep("memory.max_total_tokens=8000,60000"), parse_sweep("cache.eviction_policy=lru,lfu")])
    options = ReplayOptions("burst")
    plan = plan_study(points, _engine_config("sglang-0.5.5"), trace, options)
    assert [task.same_as for task in plan.tasks if task.kind == "point"] == [None, 0, None, 2]
    ran = []
    real = study_mod.run_task
    monkeypatch.setattr(executors, "run_task", lambda task, context: ran.append(task.index) or real(task, context))
    context = StudyContext(trace, options, shared_prefix_lens(trace))
    state = run_tasks(StudyState(plan), context, serial)
    assert sorted(ran) == [0, 2, 4]  # the two lru points and the reference
    for task in plan.tasks[:4]:
        row = state.rows[task.key]
        assert row["eviction_policy"] == task.point["cache.eviction_policy"]
        if task.same_as is None:
            assert "same_as" not in row
            continue
        assert row["same_as"] == task.same_as
        alone = point_row(replay(task.config, trace, options, None, context.shared))
        assert alone["eviction_policy"] == "lfu"
        assert _without(row, "same_as") == _without(alone)
    assert state.rows[plan.tasks[1].key]["evictions"] > 0  # the small pool evicts: the order mattered


def test_a_point_whose_policy_orders_otherwise_is_replayed(trace):
    """0.5.23 counts a hit on insert: its LFU is not LRU, and every point is its own replay."""
    points = grid_points([parse_sweep("memory.max_total_tokens=8000"), parse_sweep("cache.eviction_policy=lru,lfu,fifo")])
    plan = plan_study(points, _engine_config("sglang-0.5.23"), trace, ReplayOptions("burst"))
    assert [task.same_as for task in plan.tasks] == [None] * len(plan.tasks)
    plan = plan_study(points, _engine_config("sglang-0.5.5"), trace, ReplayOptions("burst"))
    assert [task.same_as for task in plan.tasks if task.kind == "point"] == [None, 0, None]


def test_resume_fills_a_same_point_from_its_replayed_twin(trace_path, tmp_path, monkeypatch):
    out = tmp_path / "study"
    sweep = ["--engine", "sglang-0.5.5", "--sweep", "memory.max_total_tokens=8000", "--sweep",
             "cache.eviction_policy=lru,lfu"]
    first = invoke(trace_path, "--block-size", 32, *SMALL, *sweep, "--jobs", 1, "--out", out, "--json")
    assert first.exit_code == 0, first.stderr
    doc = json.loads(first.stdout)
    lfu = next(p for p in doc["points"] if p["config"]["cache.eviction_policy"] == "lfu")
    assert lfu["same_as"] == 0 and "the replay of point 0" in invoke(
        trace_path, "--block-size", 32, *SMALL, *sweep, "--jobs", 1).stdout
    with open(out / "study.csv") as fh:
        assert [row["same_as"] for row in csv.DictReader(fh)][:2] == ["", "0"]
    # The lfu row lost (an interrupted study): --resume takes it from the lru row, replaying nothing.
    (out / "study.json").write_text(json.dumps(dict(doc, points=[p for p in doc["points"] if p is not lfu])))
    ran = []
    from memcli.tools.study import executors
    monkeypatch.setattr(executors, "run_task", lambda task, context: ran.append(task.index))
    resumed = invoke(trace_path, "--block-size", 32, *SMALL, *sweep, "--jobs", 1, "--out", out, "--resume", "--json")
    assert resumed.exit_code == 0, resumed.stderr
    assert ran == []
    assert _without(json.loads(resumed.stdout)["points"][1]) == _without(lfu)


def test_a_settled_worker_freezes_what_it_holds():
    """A worker's modules and context leave the collector's generations (`settle`), so the full
    collection after each replay walks that replay's objects only."""
    import gc

    from memcli.tools.study.executors import settle

    try:
        settle()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
