"""Bad input from the issue's list: each ends in exit 2 with `error:` / `hint:` lines."""

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app

TRACE = "tests/data/conversation_head300.jsonl"


def run(*args):
    return CliRunner().invoke(app, list(args))


def assert_bad_input(result, text):
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error: ") and text in lines[0], lines
    assert lines[1].startswith("hint: ") and "Traceback" not in result.output


@pytest.mark.parametrize("setting, text", [
    ("sim.step_base_ms=.nan", "sim.step_base_ms: invalid value nan"),
    ("sim.step_base_ms=.inf", "sim.step_base_ms: invalid value inf"),
    ("sim.step_base_ms=-5", "sim.step_base_ms: invalid value -5.0"),
])
def test_non_finite_and_negative_costs_stop_the_replay_up_front(setting, text):
    assert_bad_input(run("replay", TRACE, "--set", setting), text)


def test_nan_budget(tmp_path):
    assert_bad_input(run("show-config", "--set", "memory.kv_budget_gib=.nan", "--set", "memory.max_total_tokens=null"),
                     "memory.kv_budget_gib: invalid value nan")


def test_binary_config(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(bytes(range(128, 256)))
    assert_bad_input(run("show-config", "--config", str(path)), "not UTF-8 text")


def test_bench_radix_negative_threads():
    assert_bad_input(run("bench-radix", "--trace", TRACE, "--threads", "-1"), "--threads -1")


def test_gen_trace_refuses_a_huge_trace_before_generating(tmp_path):
    result = run("gen-trace", str(tmp_path / "t.jsonl"), "--system-prompt-len", "100000000", "--requests", "2")
    assert_bad_input(result, "over --max-tokens 50,000,000")
    assert not (tmp_path / "t.jsonl").exists()


def test_a_key_replay_does_not_read_is_reported_as_ignored():
    result = run("replay", TRACE, "--limit", "2", "--set", "runtime.seed=7", "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("note: runtime.seed is ignored by replay: ")
    assert '"ignored_keys": [\n    "runtime.seed"\n  ]' in result.stdout


def test_the_retired_write_kv_key_is_a_config_error_with_a_hint():
    result = run("replay", TRACE, "--limit", "2", "--set", "sim.write_kv=true")
    assert_bad_input(result, "unknown config key 'sim.write_kv'")
    assert "hint: sim.write_kv was retired" in result.stderr


def test_an_unexpected_exception_is_one_error_line_and_exit_1(capsys, monkeypatch):
    """The last resort: a bug inside a command ends in exit 1 with `error:`/`hint:`, no traceback
    (every `except` clause on the way must itself be valid for the installed typer)."""
    from memcli.cli.guard import INTERNAL_ERROR, run_guarded

    monkeypatch.delenv("MEMCLI_DEBUG", raising=False)

    def boom():
        raise RuntimeError("planted")

    assert run_guarded(boom) == 1
    err = capsys.readouterr().err
    assert f"error: {INTERNAL_ERROR}: RuntimeError: planted" in err and "Traceback" not in err


def test_ctrl_c_is_exit_130(capsys):
    from memcli.cli.guard import INTERRUPTED, run_guarded

    def interrupt():
        raise KeyboardInterrupt

    assert run_guarded(interrupt) == INTERRUPTED


def test_an_error_reads_as_its_error_line_then_its_hint():
    from memcli.errors import MemcliError

    assert MemcliError("no such file", "check the path").lines() == "error: no such file\nhint: check the path"
    assert MemcliError("no such file").lines() == "error: no such file"
