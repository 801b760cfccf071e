"""One request-fits check for every command: replay and check-page-size judge the same trace
the same way, with the same message (only the flag for fewer requests is the command's own)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcli.capacity import check_fits, pool_need
from memcli.cli.app import app
from memcli.config import load_config
from memcli.errors import CapacityError
from memcli.workload.readers import read_trace

# Both commands' built-in configs differ; these settings fix everything the check reads.
SETS = ["--set", "memory.page_size=16", "--set", "memory.max_context_len=4096", "--set", "memory.max_total_tokens=4096",
        "--set", "memory.kv_budget_gib=null", "--set", "scheduler.max_new_tokens_clip=64"]
MEMCLI_PROFILE = ["--set", "semantics.profile=memcli"]


def write(path, *requests: tuple[int, int]):
    path.write_text("".join(json.dumps({"rid": f"r{i}", "input_len": n, "output_len": m}) + "\n"
                            for i, (n, m) in enumerate(requests)))
    return str(path)


def replay(trace: str, *sets: str):
    return CliRunner().invoke(app, ["replay", trace, "--arrivals", "burst", *SETS, *sets])


def check_page_size(trace: str, *sets: str):
    return CliRunner().invoke(app, ["check-page-size", "--workload", trace, "--steps", "0", *SETS, *sets])


@pytest.mark.parametrize("profile", [["--strict-limits"], MEMCLI_PROFILE], ids=["sglang-0.5.5", "memcli"])
def test_an_oversized_request_is_refused_by_both_with_the_same_error(tmp_path, profile):
    """Under --strict-limits (SGLang's limits would clip the request) or the memcli profile (no
    such limits: a request fits its row or not)."""
    trace = write(tmp_path / "t.jsonl", (40, 8), (4000, 200), (30, 4))
    by_replay, by_check = replay(trace, *profile), check_page_size(trace, *profile[1:] if profile[0] == "--strict-limits" else profile)
    assert by_replay.exit_code == by_check.exit_code == 2
    error, hint = by_replay.stderr.splitlines()[:2]
    assert error.startswith(f"error: {trace}:2: request r1 (#2) needs ")
    hint = hint.split(" (or drop --strict-limits")[0]  # replay's own way out, under --strict-limits
    assert by_check.stderr.splitlines()[:2] == [error, hint.replace("--limit 1", "--requests 1")]
    assert "replay fewer requests (--limit 1)" in hint


def test_a_request_that_fills_the_pool_exactly_fits_both(tmp_path):
    """input + output = the pool, output past the clip: it is admitted and held (the rule of
    `pool_need`), so neither command refuses it."""
    trace = write(tmp_path / "t.jsonl", (40, 8), (4000, 96))
    assert pool_need(load_config(None, ["memory.page_size=16", "scheduler.max_new_tokens_clip=64"]), 4000, 96) == 4096
    by_replay, by_check = replay(trace, *MEMCLI_PROFILE), check_page_size(trace, *MEMCLI_PROFILE)
    assert by_replay.exit_code == 0, by_replay.stderr
    assert by_check.exit_code == 0, by_check.stderr


def test_the_hint_names_the_commands_flag_and_holds_every_request(tmp_path):
    trace = read_trace(write(tmp_path / "t.jsonl", (40, 8), (5000, 100), (7000, 100)))
    config = load_config(None, ["memory.max_context_len=4096", "memory.max_total_tokens=4096",
                                "memory.kv_budget_gib=null", "semantics.profile=memcli"])
    with pytest.raises(CapacityError) as exc:
        check_fits(config, trace.requests, "here", fewer_flag="--requests")
    assert exc.value.message.startswith("here:2: request r1 (#2) needs 5100 tokens")
    assert exc.value.hint == ("replay fewer requests (--requests 1), or hold every request of the trace:"
                              " --set memory.max_context_len=7100 --set memory.max_total_tokens=7101")
    check_fits(config, trace.requests[:1], "here")


@pytest.mark.parametrize("engine, kept", [("sglang-0.5.5", 94), ("sglang-0.5.23", 79)])
def test_sglang_limits_abort_and_clip_as_its_scheduler_does(tmp_path, engine, kept):
    """max_req_len = min(4096, 4096) - 1 = 4095: a prompt of 4090 tokens or more is aborted at
    arrival, an output clipped to 4095 - input - 1 = 94 (0.5.23 then also to the memory left:
    pool - ceil_page(input) - page - 1 = 4096 - 4000 - 16 - 1 = 79). The replay runs the rest,
    reports each cut request with its line, warns once, exits 0; the scheduler cut exactly those."""
    from memcli.tools.replay.runner import ReplayOptions, replay as run

    path = write(tmp_path / "t.jsonl", (40, 8), (4000, 200), (4090, 2), (30, 4), (5000, 1))
    result = replay(path, "--json", "--engine", engine)
    assert result.exit_code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "2 requests aborted at arrival, 1 with its output clipped" in warnings[0]
    doc = json.loads(result.stdout)
    limits = doc["limits"]
    assert (limits["aborted"], limits["clipped"]) == (2, 1) and "max_req_len 4095" in limits["rule"]
    assert [(r["rid"], r["line"], r["action"], r["kept_output_len"]) for r in limits["requests"]] == [
        ("r1", 2, "clipped", kept), ("r2", 3, "aborted", 0), ("r4", 5, "aborted", 0)]
    assert doc["summary"]["aborted"] == 2 and doc["summary"]["finished"] == 3
    # The scheduler's own cuts agree, request by request.
    config = load_config(None, [s for s in SETS if s != "--set"] + [f"semantics.engine={engine}"])
    trace = read_trace(path)
    out = run(config, trace, ReplayOptions("burst"))
    assert out.requests_log.aborted.tolist() == [False, False, True, False, True]
    assert out.requests_log.output_tokens.tolist() == [8, kept, 0, 4, 0]
    text = replay(path, "--engine", engine).stdout
    assert "aborted at arrival: r2 (line 3), r4 (line 5)" in text and "output clipped: r1 (line 2)" in text


def test_strict_limits_refuses_and_a_trace_without_cuts_has_no_limits_section(tmp_path):
    path = write(tmp_path / "t.jsonl", (40, 8), (4090, 2))
    strict = replay(path, "--strict-limits")
    assert strict.exit_code == 2 and strict.stderr.startswith(f"error: {path}:2: request r1 (#2) needs ")
    assert "(or drop --strict-limits: the engine aborts or clips such requests" in strict.stderr
    fine = replay(write(tmp_path / "u.jsonl", (40, 8), (30, 4)), "--json")
    assert fine.exit_code == 0 and "limits" not in json.loads(fine.stdout) and "warning:" not in fine.stderr


def test_an_impossible_config_is_still_bad_input(tmp_path):
    path = write(tmp_path / "t.jsonl", (40, 8), (4090, 2))
    result = replay(path, "--set", "memory.max_context_len=8192")  # longer than the pool
    assert result.exit_code == 2 and "longer than the pool" in result.stderr


def test_sglang_0523_clips_outputs_to_memory_as_its_scheduler_does(tmp_path):
    """0.5.23 aborts the same prompts and also clips max_new_tokens to what the pool holds beside
    the prompt's pages and one page (request_limits: memory_clip): r1's 4,000-token prompt keeps
    4096 - 4000 - 16 - 1 = 79 output tokens, not 0.5.5's 94; the scheduler agrees."""
    from memcli.tools.replay.runner import ReplayOptions, replay as run

    path = write(tmp_path / "t.jsonl", (40, 8), (4000, 200), (4090, 2), (30, 4), (5000, 1))
    result = replay(path, "--engine", "sglang-0.5.23", "--json")
    assert result.exit_code == 0, result.stderr
    limits = json.loads(result.stdout)["limits"]
    assert "memory_clip" in limits["rule"]
    assert [(r["rid"], r["action"], r["kept_output_len"]) for r in limits["requests"]] == [
        ("r1", "clipped", 79), ("r2", "aborted", 0), ("r4", "aborted", 0)]
    config = load_config(None, [s for s in SETS if s != "--set"] + ["semantics.engine=sglang-0.5.23"])
    out = run(config, read_trace(path), ReplayOptions("burst"))
    assert out.requests_log.aborted.tolist() == [False, False, True, False, True]
    assert out.requests_log.output_tokens.tolist() == [8, 79, 0, 4, 0]
