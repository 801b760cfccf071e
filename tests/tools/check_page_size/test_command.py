"""`check-page-size`: consistent stacks pass, injected mismatches and planted faults are
reported with the check that breaks first, traces replay, bad input exits 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memcli.tools.check_page_size.run import run_check_page_size
from memcli.cli.app import app
from memcli.config import load_config
from memcli.workload.generate import generate_trace, write_trace

runner = CliRunner()
TRACE = Path(__file__).resolve().parents[2] / "data" / "conversation_head300.jsonl"
# The first 20 requests of the trace: the longest needs 87,571 tokens.
TRACE_SETS = [
    "--set", "memory.page_size=64", "--set", "memory.max_context_len=98304",
    "--set", "memory.max_total_tokens=196608", "--set", "scheduler.chunked_prefill_size=8192",
    "--set", "scheduler.max_prefill_tokens=16384", "--set", "memory.max_running_requests=16",
]


def config(*sets: str):
    return load_config(None, ["runtime.device=cpu", *sets])


def invoke(*args: str):
    return runner.invoke(app, ["check-page-size", "--set", "runtime.device=cpu", *map(str, args)],
                         env={"NO_COLOR": "1"})


def main_phase(result, index: int = 0):
    return result.runs[index].phases[0]


@pytest.mark.parametrize("cache", ["radix", "chunk"])
def test_consistent_stacks_pass_at_every_page_size(cache):
    result = run_check_page_size(config(f"cache.kind={cache}"), page_sizes=[1, 4, 16, 64])
    assert result.exit_code == 0, [(r.page_size, p.violation) for r in result.runs for p in r.phases]
    for run in result.runs:
        assert run.static.ok and run.static.mismatched == []
        cov = main_phase(result, result.runs.index(run)).coverage
        assert cov["finished"] + cov["aborts_waiting"] + cov["aborts_running"] + cov["aborts_chunked"] == 30
        assert cov["drained"] == 0 and cov["scheduler_aborts"] == 0
        assert cov["chunked_requests"] > 0 and cov["page_boundary_decodes"] > 0
        assert cov["forced_retractions"] > 0
        assert min(cov["aborts_waiting"], cov["aborts_running"], cov["aborts_chunked"]) == 1
        if run.page_size > 1:
            assert cov["prompts_ending_mid_page"] > 0
        if cache == "radix":
            assert cov["radix_hits"] > 0 and cov["evictions"] > 0
        assert all(p.ok for p in run.phases)
    assert [row["page_size"] for row in result.comparison()] == [1, 4, 16, 64]


def test_costs_grow_with_the_page_size():
    result = run_check_page_size(config(), page_sizes=[1, 16], steps=0)
    one, sixteen = (run.cost for run in result.runs)
    assert (one.waste_per_request, one.shortest_hit, one.reuse_lost_per_divergence) == (0, 1, 0)
    assert (sixteen.waste_per_request, sixteen.shortest_hit, sixteen.reuse_lost_per_divergence) == (7.5, 16, 7.5)
    assert sixteen.waste_at_max_running == 7.5 * 64
    assert all(run.phases == [] for run in result.runs) and result.exit_code == 0


@pytest.mark.parametrize("component, phase, check, says", [
    ("tree_cache", 0, "no_exception", "PageSizeMismatch"),
    ("allocator", 0, "no_exception", "PageSizeMismatch"),
    ("scheduler", 0, "chunk_alignment", "prefill budget rounds with page size 1"),
    ("kv_pool", 0, "slot_range", "past the end of the KV buffer"),
    ("null_cache", 1, "no_exception", "PageSizeMismatch"),
])
def test_each_injected_mismatch_is_reported_with_what_breaks_first(component, phase, check, says):
    steps = 60 if phase else 3000  # a null cache mismatch shows in the bench phase only
    result = run_check_page_size(config("memory.page_size=16"), injections={component: 1}, steps=steps)
    assert result.exit_code == 1
    run = result.runs[0]
    assert run.static.mismatched == [component]
    agree = next(c for c in run.static.checks if c.name == "page sizes agree")
    assert not agree.ok and f"{component} holds 1" in agree.detail
    violation = run.phases[phase].violation
    assert violation is not None and violation.name == check and says in violation.detail
    assert violation.step is not None


def test_injected_kv_pool_also_fails_the_rows_rule():
    run = run_check_page_size(config("memory.page_size=16"), injections={"kv_pool": 1}, steps=0).runs[0]
    rows = next(c for c in run.static.checks if c.name == "KV rows == size + page size")
    assert not rows.ok and "runs past the buffer" in rows.detail


def _hold_page(sched):
    """A running request with an own page, and the row of req_to_token it uses."""
    req = next(r for r in sched.active_reqs() if r.kv_allocated_len > r.last_matched_prefix_len + 2)
    return req, sched.memory.stack.req_to_token_pool.req_to_token[req.req_pool_idx]


def free_held_page(sched, record):
    if record.step == 40:
        req, row = _hold_page(sched)
        sched.memory.stack.allocator.free(row[req.kv_allocated_len - 1:req.kv_allocated_len].to(torch.int64))


def point_at_free_page(sched, record):
    if record.step == 40:
        req, row = _hold_page(sched)
        ps = sched.memory.stack.allocator.page_size
        start = (req.kv_allocated_len - 1) // ps * ps
        page = int(sched.memory.stack.allocator.free_page_ids()[0])
        row[start:req.kv_allocated_len] = torch.arange(req.kv_allocated_len - start, dtype=row.dtype) + page * ps


def misalign_row(sched, record):
    if record.step == 40:
        req, row = _hold_page(sched)
        pos = next(p for p in range(req.last_matched_prefix_len, req.kv_allocated_len) if p % 16 == 1)
        row[pos] += 1


@pytest.mark.parametrize("hook, check, others", [
    (free_held_page, "free_list", {"conservation"}),
    (point_at_free_page, "free_list", {"no_lost_page"}),
    (misalign_row, "row_layout", set()),
])
def test_planted_faults_are_caught_by_the_right_check(hook, check, others):
    result = run_check_page_size(config("memory.page_size=16"), fault_hook=hook)
    assert result.exit_code == 1
    phase = main_phase(result)
    assert phase.violation.name == check and phase.violation.step == 40 and phase.violation.rid is not None
    assert others <= {v.name for v in phase.also_failed}
    assert phase.steps == 41
    assert next(c for c in phase.checks if c.name == check).status == "fail"


def test_trace_replay_runs_and_drains(tmp_path):
    result = invoke("--workload", TRACE, "--requests", 20, "--steps", 30, "--json", "--allow-unfinished", *TRACE_SETS)
    assert result.exit_code == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    phase = doc["runs"][0]["phases"][0]
    assert phase["ok"] and phase["steps"] == 30 and phase["coverage"]["requests"] == 20
    assert phase["coverage"]["drained"] > 0 and phase["coverage"]["chunked_requests"] > 0
    assert doc["workload"].startswith("trace ")
    for key in ("static_adjustments", "dynamic_adjustments"):  # the trace runs on the config as given
        assert [a["key"] for a in doc["runs"][0][key]] == ["memory.kv_pool"]


def test_trace_request_that_does_not_fit_is_bad_input():
    result = invoke("--workload", TRACE, "--requests", 5)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {TRACE}:1: request 1 (#1) needs 7258 tokens")
    assert "more than memory.max_context_len 4096" in result.stderr
    assert "hint: hold every request of the trace: --set memory.max_context_len=8032" in result.stderr


def test_trace_hint_names_the_requests_before_the_one_that_does_not_fit():
    result = invoke("--workload", TRACE, "--requests", 5, "--set", "memory.max_context_len=7300",
                    "--set", "memory.max_total_tokens=16384")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {TRACE}:2: request 2 (#2) needs 7812 tokens")
    assert "hint: replay fewer requests (--requests 1), or hold every request" in result.stderr


def test_json_is_one_document():
    result = invoke("--set", "memory.page_size=16", "--steps", 60, "--json", "--allow-unfinished")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["command"] == "check-page-size" and doc["ok"] is True and doc["exit_code"] == 0
    assert doc["profile"] == "sglang-0.5.23"  # the dynamic workload runs the default engine's profile
    run = doc["runs"][0]
    assert [c["name"] for c in run["static"]["components"]] == [
        "config", "kv_pool", "allocator", "tree_cache", "scheduler", "null_cache"]
    assert run["cost"]["shortest_hit_prefix_tokens"] == 16
    assert {a["key"] for a in run["dynamic_adjustments"]} >= {"memory.max_total_tokens", "memory.kv_pool"}
    assert [p["name"] for p in run["phases"]] == ["workload (radix cache, overlap loop)",
                                                  "bench path (null cache, overlap loop)",
                                                  "workload (radix cache, normal loop)"]
    assert [p["event_loop"] for p in run["phases"]] == ["overlap", "overlap", "normal"]
    assert all(p["ok"] for p in run["phases"])
    assert run["phases"][0]["coverage"]["drained"] > 0 and len(doc["comparison"]) == 1
    assert result.stderr == ""


def test_human_output_of_an_injected_mismatch():
    result = invoke("--set", "memory.page_size=16", "--inject", "tree_cache.page_size=1")
    assert result.exit_code == 1
    out = result.stdout
    for text in ("components: the page size each holds or reads", "static checks", "cost of page size 16",
                 "first violation: step 0, check no_exception", "PageSizeMismatch", "tree_cache holds 1",
                 "1 (injected)", "result: "):
        assert text in out, text


def test_several_page_sizes_side_by_side():
    result = invoke("--page-size", "1", "16", "--steps", 40, "--allow-unfinished")
    assert result.exit_code == 0, result.stderr
    assert "page sizes side by side" in result.stdout
    assert "check-page-size: page size 1" in result.stdout and "check-page-size: page size 16" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--inject", "cache.page_size=1"], "unknown component 'cache'"),
    (["--inject", "tree_cache.page_size=abc"], "is not an integer"),
    (["--inject", "tree_cache.page_size=3"], "a page size is a power of two"),
    (["--inject", "tree_cache=1"], "expected COMPONENT.page_size=N"),
    (["--page-size", "3"], "--page-size 3: a page size is a power of two"),
    (["--page-size", "x"], "not an integer"),
    (["--steps", "-1"], "--steps -1"),
    (["--workload", "/nonexistent/trace.jsonl"], "cannot read"),
    (["--set", "memory.page_size=3"], "memory.page_size"),
])
def test_bad_input_exits_2_with_error_and_hint(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.stdout
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert "\nhint: " in result.stderr and "Traceback" not in result.stderr


# -- requests that do not finish within --steps --------------------------------------------


@pytest.fixture(scope="module")
def chat_trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    write_trace(generate_trace(16, seed=1, system_prompt_len=96, input_len=40, output_len=30, rate=20), path)
    return path


def test_unfinished_requests_exit_1_and_the_hinted_steps_finish_them(chat_trace):
    short = invoke("--workload", chat_trace, "--page-size", 16, "--steps", 25)
    assert short.exit_code == 1, short.stdout + short.stderr
    assert "did not finish within --steps 25 (exit 1)" in short.stdout
    hint = short.stderr.strip().splitlines()[-1]
    assert hint.startswith("hint: raise the limit: --steps ") and "--allow-unfinished" in hint
    steps = int(re.search(r"--steps (\d+)", hint).group(1))
    followed = invoke("--workload", chat_trace, "--page-size", 16, "--steps", steps, "--json")
    assert followed.exit_code == 0, followed.stdout + followed.stderr
    doc = json.loads(followed.stdout)
    assert doc["unfinished"] == 0 and followed.stderr == ""
    assert all(p["coverage"]["finished"] == 16 for p in doc["runs"][0]["phases"] if p["name"].startswith("workload"))


def test_the_hint_covers_every_page_size(chat_trace):
    small = run_check_page_size(config("scheduler.chunked_prefill_size=null", "scheduler.max_prefill_tokens=100"),
                                [1, 64], workload=chat_trace, steps=5)
    assert small.steps_hint == max(run.steps_to_finish for run in small.runs) > 5
    assert small.runs[0].steps_to_finish != small.runs[1].steps_to_finish  # chunks are floored to each page size


def test_allow_unfinished_exits_0_and_still_reports_them(chat_trace):
    result = invoke("--workload", chat_trace, "--steps", 25, "--allow-unfinished", "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["unfinished"] > 0 and doc["allow_unfinished"] is True and doc["ok"] is True
    assert doc["comparison"][0]["unfinished"] == doc["unfinished"]
    completion = next(c for c in doc["runs"][0]["phases"][0]["checks"] if c["name"] == "completion")
    assert "stopped unfinished at the step limit" in completion["detail"]


def test_a_count_has_one_name_in_every_table():
    from memcli.tools.check_page_size.report import COMPARISON_ROWS, COVERAGE_LABELS

    result = run_check_page_size(config(), [1, 16], steps=400)
    for label, key in COMPARISON_ROWS:
        if key in COVERAGE_LABELS:
            assert label == COVERAGE_LABELS[key], key
    for row, run in zip(result.comparison(), result.runs):
        coverage = run.phases[0].coverage
        assert (row["pressure_retractions"], row["forced_retractions"]) == (
            coverage["pressure_retractions"], coverage["forced_retractions"])
        assert row["forced_retractions"] > 0  # the built-in workload forces some


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_hiradix_host_pool_is_a_page_size_holder(page_size):
    result = run_check_page_size(config("cache.kind=hiradix"), page_sizes=[page_size], steps=3000)
    run = result.runs[0]
    assert result.exit_code == 0, [p.violation for p in run.phases]
    host = next(c for c in run.static.components if c.name == "host_pool")
    assert host.page_size == page_size and host.holder == "HostKVPool" and host.agrees


def test_an_injected_host_pool_page_size_breaks_the_backups():
    result = run_check_page_size(config("cache.kind=hiradix"), injections={"host_pool": 16}, steps=3000)
    assert result.exit_code == 1
    run = result.runs[0]
    assert run.static.mismatched == ["host_pool"]
    violation = run.phases[0].violation
    assert violation.name == "no_exception" and "host alloc" in violation.detail and "page_size 16" in violation.detail
    assert run.phases[1].ok  # the bench path has no host pool


def test_trace_request_at_the_context_needs_sglangs_two_tokens(tmp_path):
    """Under the sglang-0.5.5 profile a request of exactly max_context_len tokens would have
    its output clipped (semantics.request_limits), so it is refused with the reason; the
    memcli profile runs it."""
    from memcli.config import load_config
    from memcli.errors import CapacityError
    from memcli.capacity import check_fits
    from memcli.tools.check_page_size.workload import trace_workload

    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"rid": "a", "input_len": 4000, "output_len": 96}) + "\n")
    workload = trace_workload(trace, 1)
    with pytest.raises(CapacityError) as exc:
        check_fits(load_config(None, ["memory.max_context_len=4096", "memory.max_total_tokens=16384"]),
                   workload.requests, workload.name, "--requests")
    assert "runs whole only with max_context_len >= 4098" in exc.value.message
    assert "semantics.request_limits" in exc.value.message
    check_fits(load_config(None, ["memory.max_context_len=4096", "memory.max_total_tokens=16384",
                                  "semantics.profile=memcli"]), workload.requests, workload.name, "--requests")


@pytest.mark.parametrize("page_size", [1, 16])
def test_0523_aborts_a_chunked_request_before_its_chunk_committed_and_keeps_the_tree(page_size):
    """Under sglang-0.5.23 the workload aborts a chunked request whose first chunk has not
    committed yet: its release checkpoints nothing and frees only its own slots, never the
    prefix it matched in the tree (which once went back to the free list while still cached)."""
    result = invoke("--engine", "sglang-0.5.23", "--page-size", page_size, "--steps", 120, "--allow-unfinished",
                    "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 0 and doc["ok"] is True, result.stdout
    assert sum(p["coverage"]["aborts_chunked"] for p in doc["runs"][0]["phases"]) >= 1
