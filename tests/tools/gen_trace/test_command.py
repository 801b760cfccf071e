"""`memcli gen-trace` through the CLI: exit codes, stdout/stderr, overwrite rules."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.workload.readers import read_trace

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["gen-trace", *map(str, args)])


def test_writes_a_readable_trace_and_json_summary(tmp_path):
    out = tmp_path / "t.jsonl"
    result = invoke(out, "--requests", 30, "--seed", 4, "--turns", 2, "--input-len", 16, "--output-len", 8, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["path"] == str(out) and doc["bytes"] == out.stat().st_size
    assert doc["params"]["seed"] == 4 and doc["params"]["turns"] == 2
    summary = doc["summary"]
    trace = read_trace(out)
    assert summary["num_requests"] == trace.num_requests == 30
    assert summary["input_tokens"] == trace.input_tokens
    assert summary["output_tokens"] == trace.output_tokens
    assert 0 < summary["reusable_fraction"] < 1
    assert result.stderr == ""


def test_human_summary(tmp_path):
    out = tmp_path / "t.jsonl"
    result = runner.invoke(app, ["gen-trace", str(out), "-n", "12"], env={"NO_COLOR": "1"})
    assert result.exit_code == 0
    assert "num_requests" in result.stdout and "12" in result.stdout
    assert "reusable_input_tokens" in result.stdout


def test_same_seed_same_file(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert invoke(a, "-n", 25, "--seed", 9).exit_code == 0
    assert invoke(b, "-n", 25, "--seed", 9).exit_code == 0
    assert a.read_bytes() == b.read_bytes()


def test_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "t.jsonl"
    out.write_text("precious\n")
    result = invoke(out, "-n", 5)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and "already exists" in result.stderr
    assert "hint: " in result.stderr and "--force" in result.stderr
    assert result.stdout == ""
    assert out.read_text() == "precious\n"
    result = invoke(out, "-n", 5, "--force")
    assert result.exit_code == 0
    assert read_trace(out).num_requests == 5


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--requests", "0"], "--requests"),
        (["--seed", "-1"], "--seed"),
        (["--turns", "0"], "--turns"),
        (["--input-len", "0"], "--input-len"),
        (["--output-len", "-3"], "--output-len"),
        (["--system-prompts", "-1"], "--system-prompts"),
        (["--rate", "-2"], "--rate"),
    ],
)
def test_bad_arguments_exit_2(tmp_path, args, flag):
    out = tmp_path / "t.jsonl"
    result = invoke(out, *args)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and flag in result.stderr
    assert "hint: " in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_unwritable_path(tmp_path):
    result = invoke(tmp_path / "missing-dir" / "t.jsonl", "-n", 3)
    assert result.exit_code == 2
    assert "error: cannot write" in result.stderr and "hint: " in result.stderr


def test_unparseable_option_is_a_usage_error(tmp_path):
    result = invoke(tmp_path / "t.jsonl", "--requests", "many")
    assert result.exit_code == 2
    assert not (tmp_path / "t.jsonl").exists()


def test_the_same_options_again_leave_the_file_and_exit_0(tmp_path):
    out = tmp_path / "t.jsonl"
    assert invoke(out, "-n", 20, "--seed", 5).exit_code == 0
    before = (out.read_bytes(), out.stat().st_mtime_ns)
    again = invoke(out, "-n", 20, "--seed", 5, "--json")
    assert again.exit_code == 0, again.stderr
    assert again.stderr == f"note: {out} already holds this trace (same options and seed): left as it is\n"
    doc = json.loads(again.stdout)
    assert doc["unchanged"] is True and doc["bytes"] == len(before[0]) and doc["summary"]["num_requests"] == 20
    assert (out.read_bytes(), out.stat().st_mtime_ns) == before


@pytest.mark.parametrize("other", [["-n", "21", "--seed", "5"], ["-n", "20", "--seed", "6"]])
def test_other_options_over_an_existing_trace_need_force(tmp_path, other):
    out = tmp_path / "t.jsonl"
    assert invoke(out, "-n", 20, "--seed", 5).exit_code == 0
    before = out.read_bytes()
    result = invoke(out, *other)
    assert result.exit_code == 2 and "already exists and holds another trace" in result.stderr
    assert out.read_bytes() == before
    forced = invoke(out, *other, "--force", "--json")
    assert forced.exit_code == 0 and json.loads(forced.stdout)["unchanged"] is False
    assert out.read_bytes() != before


def test_a_file_cut_short_is_another_trace(tmp_path):
    out = tmp_path / "t.jsonl"
    assert invoke(out, "-n", 20).exit_code == 0
    out.write_bytes(out.read_bytes()[:-10])
    assert invoke(out, "-n", 20).exit_code == 2


def test_progress_only_when_asked_or_on_a_terminal(tmp_path):
    quiet = invoke(tmp_path / "a.jsonl", "-n", 600)
    assert quiet.exit_code == 0 and quiet.stderr == ""
    shown = invoke(tmp_path / "b.jsonl", "-n", 600, "--progress")
    assert shown.exit_code == 0
    for phase in ("generating", "writing", "summarizing"):
        assert phase in shown.stderr
    assert shown.stderr.count("600/600") == 3
