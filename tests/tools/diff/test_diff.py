"""`memcli diff`: equal runs are equal (exit 0), the first divergent step it reports is the first
step where the two logs differ (read here from both logs), and bad input exits 2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.tools.replay.steplog import FIELDS

TRACE = "tests/data/synthetic_head200.jsonl"
LIMIT = ["--limit", "60"]


def _log(tmp_path, name: str, *overrides: str) -> tuple:
    path = tmp_path / f"{name}.jsonl"
    sets = [arg for o in overrides for arg in ("--set", o)]
    result = CliRunner().invoke(app, ["replay", TRACE, *LIMIT, *sets, "--steps-out", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return path, [json.loads(line) for line in path.read_text().splitlines()]


def _diff(*args: str):
    result = CliRunner().invoke(app, ["diff", *args, "--json"])
    return result, (json.loads(result.stdout) if result.stdout.strip() else None)


def _first_difference(a: list, b: list):
    for i in range(max(len(a), len(b))):
        x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
        if x is None or y is None or any(x[f] != y[f] for f in FIELDS):
            return i
    return None


def _cached(log: list) -> dict:
    totals: dict = {}
    for step in log:
        for entry in step["requests"]:
            totals[entry["rid"]] = totals.get(entry["rid"], 0) + entry["cached"]
    return totals


def test_a_log_against_itself_and_a_config_against_itself_are_equal(tmp_path):
    path, log = _log(tmp_path, "a")
    result, doc = _diff(str(path), str(path))
    assert result.exit_code == 0, result.output
    assert doc["equal"] and doc["first_divergence"] is None and doc["steps_a"] == doc["steps_b"] == len(log)
    assert doc["cached_tokens"]["a"] == doc["cached_tokens"]["b"] == sum(_cached(log).values())
    result, doc = _diff(TRACE, *LIMIT, "--a", "", "--b", "--set memory.page_size=1")
    assert result.exit_code == 0 and doc["equal"] and doc["steps_a"] == len(log)


@pytest.mark.parametrize("a, b", [((), ("semantics.profile=memcli",)), ((), ("sim.step_base_ms=7",))],
                         ids=["profile", "step-cost"])
def test_the_reported_step_is_the_first_that_differs(tmp_path, a, b):
    path_a, log_a = _log(tmp_path, "a", *a)
    path_b, log_b = _log(tmp_path, "b", *b)
    expected = _first_difference(log_a, log_b)
    assert expected is not None and (expected > 0) == ("sim.step_base_ms=7" in b)
    result, doc = _diff(str(path_a), str(path_b))
    assert result.exit_code == 1, result.output
    first = doc["first_divergence"]
    assert first["position"] == expected and first["at"] == [log_a[expected], log_b[expected]]
    assert first["fields"] == [f for f in FIELDS if log_a[expected][f] != log_b[expected][f]] and first["what"]
    assert [pair for pair in first["before"]] == [[x, x] for x in log_a[max(expected - 3, 0):expected]]
    ca, cb = _cached(log_a), _cached(log_b)
    differing = {r["rid"]: (r["a"], r["b"]) for r in doc["cached_tokens"]["differing"]}
    assert differing == {rid: (ca.get(rid), cb.get(rid)) for rid in ca.keys() | cb.keys() if ca.get(rid) != cb.get(rid)}
    # The same comparison, each side replayed by diff itself.
    result, replayed = _diff(TRACE, *LIMIT, "--a", " ".join(f"--set {o}" for o in a),
                             "--b", " ".join(f"--set {o}" for o in b))
    assert result.exit_code == 1 and replayed["first_divergence"] == first
    text = CliRunner().invoke(app, ["diff", str(path_a), str(path_b)]).stdout
    assert f"first divergent step: {log_a[expected]['step']}" in text and "per-request cached tokens" in text


@pytest.mark.parametrize("line, what", [("not json\n", "not JSON"), ('{"step": 0}\n', "missing t_ms"),
                                        ("[1, 2]\n", "not a JSON object")])
def test_a_malformed_line_exits_2_naming_file_and_line(tmp_path, line, what):
    path, log = _log(tmp_path, "a")
    bad = tmp_path / "bad.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    bad.write_text("".join(lines[:4]) + line + "".join(lines[4:]))
    result = CliRunner().invoke(app, ["diff", str(path), str(bad)])
    assert result.exit_code == 2
    assert f"error: {bad}:5: {what}" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("args, what", [(["{a}"], "needs two step logs"),
                                        (["{a}", "{a}", "--a", "--set x=1"], "one file too many"),
                                        (["{a}", "{a}", "--limit", "3"], "apply to a trace"),
                                        ([TRACE, "--a", "--bogus 1"], "unknown option"),
                                        (["{a}", "{missing}"], "cannot read")])
def test_bad_usage_exits_2(tmp_path, args, what):
    path = tmp_path / "a.jsonl"
    path.write_text("")
    args = [a.format(a=path, missing=tmp_path / "nope.jsonl") for a in args]
    result = CliRunner().invoke(app, ["diff", *args])
    assert result.exit_code == 2 and what in result.output and "Traceback" not in result.output
