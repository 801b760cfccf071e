"""`replay --requests-out`: one row per request on the simulated clock, as CSV or JSON lines,
agreeing with the replay's own totals; and the queueing-delay distribution of the summary."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.tools.replay.requests import COLUMNS
from memcli.workload.generate import generate_trace, write_trace

# A pool small enough that requests queue and some are retracted.
TIGHT = ["--set", "memory.max_total_tokens=2500", "--set", "memory.max_context_len=2000",
         "--set", "memory.max_running_requests=16", "--set", "runtime.device=cpu",
         "--set", "scheduler.chunked_prefill_size=512", "--set", "scheduler.max_prefill_tokens=2048",
         "--set", "scheduler.init_new_token_ratio=0.05", "--set", "scheduler.new_token_ratio_decay_steps=10"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("r") / "chat.jsonl"
    write_trace(generate_trace(40, seed=7, system_prompts=2, system_prompt_len=300, turns=3, input_len=120,
                               output_len=60, rate=50), path)
    return path


def replay(*args):
    result = CliRunner().invoke(app, ["replay", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result


def read_csv(path):
    with path.open() as fh:
        return list(csv.DictReader(fh))


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_one_row_per_request_agreeing_with_the_replay(trace, tmp_path, suffix):
    out = tmp_path / f"requests{suffix}"
    result = replay(trace, *TIGHT, "--requests-out", out, "--json")
    doc = json.loads(result.stdout)
    assert result.stderr.endswith(f"requests: wrote 40 rows to {out}\n")
    rows = read_csv(out) if suffix == ".csv" else [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 40 and list(rows[0]) == list(COLUMNS)
    trace_rids = [json.loads(line)["rid"] for line in trace.read_text().splitlines()]
    assert [r["rid"] for r in rows] == trace_rids  # trace order
    num = (lambda v: float(v)) if suffix == ".csv" else (lambda v: v)
    assert sum(int(r["cached_tokens"]) for r in rows) == doc["prefix_cache"]["cached_tokens"]
    assert sum(int(r["output_tokens"]) for r in rows) == doc["summary"]["output_tokens"]
    assert sum(int(r["input_tokens"]) for r in rows) == doc["summary"]["input_tokens"]
    assert sum(int(r["retractions"]) for r in rows) == doc["scheduling"]["retracted_requests"] > 0
    source = [json.loads(line)["arrival_ms"] for line in trace.read_text().splitlines()]
    for row, arrival in zip(rows, source):
        assert num(row["arrival_ms"]) == pytest.approx(arrival)
        assert num(row["arrival_ms"]) <= num(row["admission_ms"]) <= num(row["finish_ms"])
        assert num(row["queueing_delay_ms"]) == pytest.approx(num(row["admission_ms"]) - num(row["arrival_ms"]), abs=2e-3)
        assert row["aborted"] in ("false", False)


def test_queueing_delay_distribution_matches_the_rows(trace, tmp_path):
    out = tmp_path / "r.jsonl"
    doc = json.loads(replay(trace, *TIGHT, "--requests-out", out, "--json").stdout)
    delays = np.array([json.loads(line)["queueing_delay_ms"] for line in out.read_text().splitlines()])
    summary = doc["summary"]["queueing_delay_ms"]
    assert summary["requests"] == 40 and delays.max() > 0
    assert summary["max"] == pytest.approx(delays.max(), abs=2e-3)
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert summary[name] == pytest.approx(np.percentile(delays, q), abs=2e-3)
    text = replay(trace, *TIGHT).stdout
    assert "queueing delay p50 / p90 / p99 / max (ms)" in text


def test_burst_arrivals_start_at_zero_and_aborted_requests_are_marked(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"rid": f"r{i}", "input_len": 50, "output_len": 5}) + "\n" for i in range(6)))
    out = tmp_path / "r.csv"
    replay(trace, "--set", "runtime.device=cpu", "--requests-out", out)
    rows = read_csv(out)
    assert {r["arrival_ms"] for r in rows} == {"0.0"} and all(r["aborted"] == "false" for r in rows)
    assert all(r["cached_tokens"] != "" and r["finish_ms"] != "" for r in rows)


@pytest.mark.parametrize("args, says", [
    (["--requests-out", "r.txt"], "unknown format '.txt'"),
    (["--requests-out", "missing/r.csv"], "cannot write there"),
    (["--requests-out", "r.csv", "--sweep", "memory.page_size=1,16"], "cannot be combined with --sweep"),
])
def test_bad_requests_out_is_bad_input_before_the_replay(trace, tmp_path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["replay", str(trace), *TIGHT, *args])
    assert result.exit_code == 2 and says in result.stderr and "hint: " in result.stderr
    assert result.stdout == "" and not list(tmp_path.glob("r.*"))
