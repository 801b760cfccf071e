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


@pytest.mark.parametrize("profile", [[], MEMCLI_PROFILE], ids=["sglang-0.5.5", "memcli"])
def test_an_oversized_request_is_refused_by_both_with_the_same_error(tmp_path, profile):
    trace = write(tmp_path / "t.jsonl", (40, 8), (4000, 200), (30, 4))
    by_replay, by_check = replay(trace, *profile), check_page_size(trace, *profile)
    assert by_replay.exit_code == by_check.exit_code == 2
    error, hint = by_replay.stderr.splitlines()[:2]
    assert error.startswith(f"error: {trace}:2: request r1 (#2) needs ")
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
