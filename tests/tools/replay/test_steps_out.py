"""The step log (`replay --steps-out`) and the timeline (`replay --timeline`) of a bundled trace,
checked against the replay's own JSON document and per-request file."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.tools.replay.steplog import FIELDS, KINDS

TRACE = "tests/data/conversation_head300.jsonl"
# A small pool: the run hits, evicts and retracts, so those fields are not all empty.
SMALL = ["--limit", "80", "--arrivals", "burst", "--set", "memory.max_total_tokens=90000",
         "--set", "memory.max_context_len=88000"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("steps")
    steps, timeline, requests = folder / "steps.jsonl", folder / "timeline.json", folder / "requests.jsonl"
    result = CliRunner().invoke(app, ["replay", TRACE, *SMALL, "--json", "--steps-out", str(steps),
                                      "--timeline", str(timeline), "--requests-out", str(requests)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    log = [json.loads(line) for line in steps.read_text().splitlines()]
    rows = [json.loads(line) for line in requests.read_text().splitlines()]
    return doc, log, json.loads(timeline.read_text()), rows


def test_every_line_has_the_schema_in_order(run):
    doc, log, _, _ = run
    assert len(log) == doc["summary"]["steps"]
    for i, step in enumerate(log):
        assert list(step)[:len(FIELDS)] == list(FIELDS)
        assert step["step"] == i and step["kind"] in KINDS
        for entry in step["requests"]:
            assert list(entry) == ["rid", "cached", "new"] and entry["new"] >= 1 and entry["cached"] >= 0
    assert [s["t_ms"] for s in log] == sorted(s["t_ms"] for s in log)


def test_the_log_adds_up_to_the_runs_summary(run):
    doc, log, _, rows = run
    summary, pool = doc["summary"], doc["allocation"]["pool_tokens"]
    kinds = [s["kind"] for s in log]
    assert kinds.count("prefill") == summary["prefill_steps"] and kinds.count("decode") == summary["decode_steps"]
    assert all(s["used"] + s["evictable"] + s["protected"] + s["free"] == pool for s in log)
    end = doc["integrity"]["end"]
    assert (log[-1]["free"], log[-1]["evictable"], log[-1]["protected"]) == (end["available"], end["evictable"],
                                                                              end["protected"])
    assert sum(len(s["finished"]) for s in log) == summary["finished"]
    assert sum(len(s["aborted"]) for s in log) == summary["aborted"]
    assert sum(len(s["retracted"]) for s in log) == doc["scheduling"]["retracted_requests"] > 0
    assert sum(s["evicted_tokens"] for s in log) == doc["eviction"]["tokens_evicted"] > 0
    decoded = sum(len(s["requests"]) for s in log if s["kind"] == "decode")
    assert decoded == doc["allocation"]["allocated_tokens"] - sum(
        e["new"] for s in log if s["kind"] == "prefill" for e in s["requests"])


def test_cached_at_first_admission_is_each_requests_cached_tokens(run):
    doc, log, _, rows = run
    first: dict[str, int] = {}
    for step in log:
        for entry in step["requests"]:
            first.setdefault(entry["rid"], entry["cached"])
    by_rid = {row["rid"]: row["cached_tokens"] for row in rows if row["cached_tokens"] is not None}
    assert first == by_rid
    assert sum(first.values()) == doc["cached_tokens"] > 0


def test_timeline_events_have_the_trace_event_fields(run):
    _, log, timeline, _ = run
    events = timeline["traceEvents"]
    assert {e["ph"] for e in events} >= {"M", "B", "E", "C", "b", "e", "n", "i"}
    for e in events:
        assert {"ph", "ts", "pid", "tid"} <= set(e), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
    steps = [e for e in events if e["ph"] in "BE" and e["tid"] == 1]
    depth = 0
    for e in steps:  # B/E alternate: each step's slice closes before the next opens
        depth += 1 if e["ph"] == "B" else -1
        assert depth in (0, 1)
    assert depth == 0 and len(steps) == 2 * len(log)
    assert [e["name"] for e in steps if e["ph"] == "B"] == [s["kind"] for s in log]
    for begin, end in zip(steps[::2], steps[1::2]):
        assert begin["ts"] <= end["ts"]
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == len(log)
    for c in counters:
        assert set(c["args"]) == {"used", "evictable", "protected", "free"}
        assert all(isinstance(v, int) for v in c["args"].values())
    evictions = [e for e in events if e["ph"] == "i"]
    assert sum(e["args"]["tokens"] for e in evictions) == sum(s["evicted_tokens"] for s in log)


def test_timeline_has_one_nested_async_slice_per_request(run):
    doc, log, timeline, rows = run
    stacks: dict[str, list] = {}
    retractions: dict[str, int] = {}
    for e in timeline["traceEvents"]:
        if e["ph"] not in "ben":
            continue
        assert e["cat"] == "request"
        stack = stacks.setdefault(e["id"], [])
        if e["ph"] == "b":
            stack.append((e["name"], e["ts"]))
        elif e["ph"] == "e":
            name, ts = stack.pop()
            assert name == e["name"] and ts <= e["ts"]
        else:
            retractions[e["id"]] = retractions.get(e["id"], 0) + 1
    assert set(stacks) == {row["rid"] for row in rows} and all(not s for s in stacks.values())
    assert retractions == {row["rid"]: row["retractions"] for row in rows if row["retractions"]}


def test_a_study_refuses_the_step_files(tmp_path):
    result = CliRunner().invoke(app, ["replay", TRACE, "--limit", "3", "--sweep", "memory.page_size=1,16",
                                      "--steps-out", str(tmp_path / "s.jsonl")])
    assert result.exit_code == 2 and "error: --steps-out" in result.output


def test_an_unwritable_step_log_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["replay", TRACE, "--limit", "3", "--steps-out", str(tmp_path / "no" / "s.jsonl")])
    assert result.exit_code == 2 and "--steps-out" in result.output and "Traceback" not in result.output
