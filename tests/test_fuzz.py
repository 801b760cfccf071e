"""Property tests: random bytes, YAML, JSON lines and `--set` strings never end in a traceback.

Each draws a seed and runs one input of `tests/fuzz.py` (the generators behind
`python -m tests.fuzz --count 10000`); examples are bounded to keep the suite fast.
"""

import random

from hypothesis import HealthCheck, given, settings, strategies as st
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.config import load_config
from memcli.errors import MemcliError
from memcli.workload.readers import read_trace
from tests import fuzz

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(data=st.binary(max_size=200))
def test_any_bytes_as_a_config_is_a_config_error_or_a_config(tmp_path, data):
    path = tmp_path / "c.yaml"
    path.write_bytes(data)
    try:
        load_config(path)
    except MemcliError:
        pass


@SETTINGS
@given(seed=st.integers(0, 2**32))
def test_random_yaml_configs(tmp_path, seed):
    fuzz.check_config_yaml(random.Random(seed), tmp_path)


@SETTINGS
@given(data=st.binary(max_size=200))
def test_any_bytes_as_a_trace(tmp_path, data):
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    try:
        read_trace(path)
    except MemcliError:
        pass


@SETTINGS
@given(seed=st.integers(0, 2**32))
def test_random_json_lines_as_a_trace(tmp_path, seed):
    fuzz.check_trace(random.Random(seed), tmp_path)


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(st.text(max_size=40), st.builds(fuzz.random_set, st.randoms(use_true_random=False))))
def test_random_set_strings_exit_0_1_or_2(text):
    result = CliRunner().invoke(app, ["show-config", "--json", "--set", text])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 1, 2)
    assert "internal error" not in result.output and "Traceback" not in result.output


def test_usage_errors_are_error_and_hint_lines():
    for args in (["foo"], ["replay"], ["replay", "x.jsonl", "--limit", "abc"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, args
        lines = result.stderr.splitlines()
        assert lines[0].startswith("error: ") and lines[1].startswith("hint: ") and len(lines) == 2, lines
    assert CliRunner().invoke(app, ["replay", "--help"]).exit_code == 0


def test_fuzz_script_counts_no_traceback():
    counts = fuzz.run(40, seed=1)
    assert all(bad == 0 for _, bad in counts.values()), counts
