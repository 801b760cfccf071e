"""`memcli replay` through the CLI: formats, bad input (exit 2), JSON schema, sweeps, plots."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.sched.scheduler import Scheduler
from memcli.workload.generate import generate_trace, write_trace

from tests.tools.replay.helpers import CONVERSATION, SYNTHETIC, plant_leak, shrink_mooncake

runner = CliRunner()
# A small CPU stack: every test below runs in well under a second.
SMALL = ["--set", "memory.max_total_tokens=60000", "--set", "memory.max_running_requests=16",
         "--set", "memory.max_context_len=60000", "--set", "memory.page_size=16",
         "--set", "runtime.device=cpu", "--set", "scheduler.chunked_prefill_size=4096",
         "--set", "scheduler.max_prefill_tokens=8192"]


def invoke(*args, env=None):
    return runner.invoke(app, ["replay", *map(str, args)], env=env)


@pytest.fixture(scope="module")
def memcli_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "gen.jsonl"
    write_trace(generate_trace(30, seed=2, system_prompts=2, system_prompt_len=48, turns=3, input_len=24,
                               output_len=12, rate=40), path)
    return path


@pytest.fixture(scope="module")
def mooncake_trace(tmp_path_factory):
    return shrink_mooncake(CONVERSATION, tmp_path_factory.mktemp("k") / "moon.jsonl", 40, block_size=32)


def run_json(*args):
    result = invoke(*args, "--json", *SMALL)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


# -- formats --------------------------------------------------------------------------------


def test_detects_memcli_format(memcli_trace):
    doc = run_json(memcli_trace)
    assert doc["trace"]["format"] == "memcli" and doc["requests"] == 30 and doc["arrivals"] == "timestamp"


def test_detects_mooncake_format_with_its_block_size(mooncake_trace):
    doc = run_json(mooncake_trace, "--block-size", 32)
    assert doc["trace"]["format"] == "mooncake" and doc["trace"]["block_size"] == 32
    assert doc["prefix_cache"]["block_ratio"]["block_size"] == 32


def test_forced_format_and_limit(memcli_trace):
    doc = run_json(memcli_trace, "--format", "memcli", "--limit", 7)
    assert doc["requests"] == 7 and doc["summary"]["finished"] == 7


def test_forcing_the_wrong_format_is_bad_input(memcli_trace):
    result = invoke(memcli_trace, "--format", "mooncake", *SMALL)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {memcli_trace}:1:") and "hint:" in result.stderr


def test_default_mooncake_block_size_is_512(mooncake_trace):
    # The shrunk trace has 32-token blocks: at 512 its hash_ids do not add up.
    result = invoke(mooncake_trace, *SMALL)
    assert result.exit_code == 2 and f"{mooncake_trace}:1:" in result.stderr and "--block-size" in result.stderr


# -- bad input: exit 2, file and line, nothing replayed --------------------------------------

BAD_LINES = {
    "not_json": ('{"input_len": 4, "output_len": 1}\n{"input_len": 4,\n', 2, "not valid JSON"),
    "missing_output": ('{"input_len": 4, "output_len": 1}\n{"input_len": 4}\n', 2, "output_len"),
    "negative_output": ('{"input_len": 4, "output_len": -1}\n', 1, "output_len"),
    "empty_input": ('{"input_ids": [], "output_len": 1}\n', 1, "input_ids"),
    "backwards_time": ('{"input_len": 4, "output_len": 1, "arrival_ms": 5}\n'
                       '{"input_len": 4, "output_len": 1, "arrival_ms": 2}\n', 2, "earlier than"),
    "duplicate_rid": ('{"rid": "a", "input_len": 4, "output_len": 1}\n'
                      '{"rid": "a", "input_len": 4, "output_len": 1}\n', 2, "duplicate rid"),
    "unknown_key": ('{"input_len": 4, "output_len": 1, "bogus": 1}\n', 1, "bogus"),
    "not_an_object": ('[1, 2]\n', 1, "expected a JSON object"),
    "mooncake_hash_count": ('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}\n', 1,
                            "hash_ids has 1 entries"),
    "mooncake_bad_time": ('{"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [1]}\n', 1,
                          "timestamp"),
    "undetectable": ('{"foo": 1}\n', 1, "cannot tell the trace format"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_lines_stop_before_the_replay(tmp_path, case, monkeypatch):
    text, line, needle = BAD_LINES[case]
    path = tmp_path / f"{case}.jsonl"
    path.write_text(text)
    monkeypatch.setattr(Scheduler, "step", lambda self: pytest.fail("the replay started"))
    result = invoke(path, *SMALL)
    assert result.exit_code == 2, result.stdout
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"error: {path}:{line}:") and needle in first
    assert "hint:" in result.stderr and result.stdout == ""
    assert "Traceback" not in result.stderr


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    result = invoke(empty, *SMALL)
    assert result.exit_code == 2 and f"error: {empty}:1:" in result.stderr
    result = invoke(tmp_path / "nope.jsonl", *SMALL)
    assert result.exit_code == 2 and "error: cannot read" in result.stderr


@pytest.mark.parametrize("args,needle", [
    (["--arrivals", "poisson"], 'unknown --arrivals "poisson"'),
    (["--format", "csv"], 'unknown trace format "csv"'),
    (["--limit", "0"], "limit must be a positive integer"),
    (["--set", "memory.bogus=1"], "unknown config key 'memory.bogus'"),
    (["--sweep", "memory.max_total_tokens"], "expected KEY=v1,v2"),
    (["--sweep", "cache.eviction_policy=lru,mru"], "cache.eviction_policy: invalid value 'mru'"),
    (["--sweep", "cache.eviction_policy=lru", "--events", "x.jsonl"], "cannot be combined with --sweep or --sweep-file"),
    (["--jobs", "2"], "--jobs runs the points of a study"),
    (["--sweep", "cache.eviction_policy=lru", "--jobs", "0"], "--jobs 0: at least 1"),
    (["--sweep", "cache.eviction_policy=lru", "--resume"], "--resume continues the study under --out"),
    (["--sweep", "cache.eviction_policy=lru", "--ray-address", "10.0.0.1:6379"], "--ray-address is the Ray cluster"),
    (["--sweep-file", "missing.yaml"], "cannot read --sweep-file missing.yaml"),
    (["--plot", "out.txt"], "unsupported file type"),
    # Requests past the limits are cut as SGLang cuts them (tests/test_capacity.py), or refused:
    (["--strict-limits", "--set", "memory.max_context_len=100"], "more than memory.max_context_len 100"),
    (["--strict-limits", "--set", "memory.max_total_tokens=200", "--set", "memory.max_context_len=64",
      "--set", "memory.page_size=1", "--set", "scheduler.chunked_prefill_size=128"],
     "more than memory.max_context_len 64"),
    (["--set", "semantics.profile=memcli", "--set", "memory.max_context_len=100"], "more than memory.max_context_len 100"),
])
def test_bad_options_exit_2_with_error_and_hint(memcli_trace, monkeypatch, args, needle):
    monkeypatch.setattr(Scheduler, "step", lambda self: pytest.fail("the replay started"))
    result = invoke(memcli_trace, *SMALL, *args)
    assert result.exit_code == 2, result.stdout
    assert result.stderr.startswith("error: ") and needle in result.stderr and "hint: " in result.stderr


def test_timestamp_arrivals_need_timestamps(tmp_path):
    path = tmp_path / "untimed.jsonl"
    write_trace(generate_trace(4, rate=0, system_prompt_len=8, input_len=4, output_len=2), path)
    result = invoke(path, *SMALL, "--arrivals", "timestamp")
    assert result.exit_code == 2 and "needs arrival times" in result.stderr
    doc = run_json(path)
    assert doc["arrivals"] == "burst"


# -- JSON -----------------------------------------------------------------------------------


def test_json_schema(memcli_trace):
    doc = run_json(memcli_trace, "--arrivals", "sequential")
    for key in ("requests", "input_tokens", "output_tokens", "cached_tokens", "hit_rate", "page_size", "config"):
        assert key in doc
    assert doc["page_size"] == doc["config"]["memory"]["page_size"] == 16
    assert doc["hit_rate"] == pytest.approx(doc["cached_tokens"] / doc["input_tokens"], abs=1e-6)
    for section in ("summary", "prefix_cache", "allocation", "eviction", "scheduling", "integrity", "series"):
        assert isinstance(doc[section], dict)
    prefix = doc["prefix_cache"]
    assert "first admitted" in prefix["hit_rate_definition"]
    for variant in ("block_ratio", "warmup_excluded", "last_1000", "ceiling", "lost_to_page_alignment",
                    "sub_page_prefix_requests", "lost_to_capacity_and_timing", "per_request_mean", "page_hit_rate",
                    "sglang_batch", "sglang_cumulative", "vllm"):
        assert prefix[variant]["definition"]
    assert prefix["belady"] is None  # only with --bound belady
    # Sequential arrivals with a pool that never evicts: exactly the ceiling.
    assert doc["eviction"]["evictions"] == 0 and prefix["ceiling"]["tokens"] == doc["cached_tokens"]
    summary = doc["summary"]
    assert summary["steps"] == summary["prefill_steps"] + summary["decode_steps"] + summary["idle_steps"]
    for key in ("simulated_time_ms", "wall_time_s", "steps_per_s"):
        assert summary[key] > 0
    for key in ("peak_used_tokens", "peak_used_pages", "mean_used_tokens", "peak_partial_page_waste_tokens",
                "allocations", "frees", "peak_request_rows", "oom_events"):
        assert key in doc["allocation"]
    eviction = doc["eviction"]
    assert set(eviction["age_ms"]) == {"p50", "p90", "max"} == set(eviction["hits_before_eviction"])
    assert set(eviction["reuse_distance_requests"]) == {"p50", "p90", "max"} and eviction["future_known"]
    assert set(eviction["definitions"]) >= {"reuse_distance", "needed_again"}
    assert doc["integrity"]["ok"] and doc["integrity"]["everything_free_at_end"]
    series = doc["series"]
    assert len(series["time_ms"]) == len(series["running"]) <= series["points"]


def test_human_output_prints_the_definition(memcli_trace):
    result = invoke(memcli_trace, *SMALL, env={"NO_COLOR": "1"})
    assert result.exit_code == 0, result.stderr
    for needle in ("prefix cache", "hit rate", "allocation", "eviction", "scheduling", "integrity",
                   "hit rate = cached_tokens / input_tokens", "SGLang per batch = ", "vLLM = "):
        assert needle in result.stdout


def test_progress_goes_to_stderr_and_stdout_stays_one_document(memcli_trace):
    result = invoke(memcli_trace, *SMALL, "--json", "--progress")
    assert result.exit_code == 0
    json.loads(result.stdout)
    assert "replay" in result.stderr and "30/30" in result.stderr
    assert "reading the trace" in result.stderr and "MB, 30 requests" in result.stderr


def test_no_progress_when_stderr_is_not_a_terminal(memcli_trace):
    result = invoke(memcli_trace, *SMALL)
    assert result.exit_code == 0 and result.stderr == ""


def test_a_study_has_one_progress_bar_over_its_replays(memcli_trace):
    result = invoke(memcli_trace, *SMALL, "--sweep", "memory.max_total_tokens=20000,60000", "--jobs", 1,
                    "--progress", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("study (serial)") >= 1 and "3/3" in result.stderr  # two points, one reference
    assert "replay " not in result.stderr.replace("study", "")


def test_plot_says_where_it_wrote(memcli_trace, tmp_path, monkeypatch):
    import memcli.tools.replay.plot as plot

    monkeypatch.setattr(plot, "require_matplotlib", lambda: None)
    monkeypatch.setattr(plot, "plot_replay", lambda result, path: path.write_bytes(b"png"))
    out = tmp_path / "o.png"
    result = invoke(memcli_trace, *SMALL, "--plot", out, "--json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == f"plot: wrote {out}\n" and out.read_bytes() == b"png"


def test_check_every_step(memcli_trace):
    doc = run_json(memcli_trace, "--check")
    assert doc["integrity"]["mode"] == "every step"
    assert doc["integrity"]["checks_run"] >= doc["summary"]["steps"]


def test_integrity_violation_exits_1_with_the_report(memcli_trace, monkeypatch):
    plant_leak(monkeypatch, after_step=3)
    result = invoke(memcli_trace, *SMALL, "--check", "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert not doc["integrity"]["ok"] and "memory leak detected" in doc["integrity"]["failure"]
    assert doc["summary"]["steps"] == 4
    # The leaked page's story: handed out after the third step (step 2), so within step 3, whose
    # check finds it; claimed by nobody; before that, freed by its last owner.
    *before, leaked = doc["integrity"]["history"]
    assert leaked["step"] == doc["integrity"]["failure_step"] == 3 and leaked["op"] == "allocator.alloc" and leaked["rid"] is None
    assert (leaked["from"], leaked["to"], leaked["what"]) == ("free", "nobody (allocated, unclaimed)",
                                                               "handed out by the allocator")
    assert all(t["page"] == leaked["page"] and t["step"] <= 3 for t in before)
    assert not before or before[-1]["to"] == "free"


def test_events_file(memcli_trace, tmp_path):
    path = tmp_path / "ev.jsonl"
    doc = run_json(memcli_trace, "--events", path)
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert events and {e["type"] for e in events} <= {"stored", "removed", "cleared"}
    assert doc["config"]["cache"]["kv_events"] is True


# -- studies (more in test_study.py) ------------------------------------------------------


def test_sweep_pool_sizes_with_the_unlimited_reference(mooncake_trace):
    doc = run_json(mooncake_trace, "--block-size", 32, "--sweep", "memory.max_total_tokens=8000,60000", "--jobs", 1)
    rows = doc["points"]
    assert [row["point"] for row in rows] == [{"memory.max_total_tokens": 8000}, {"memory.max_total_tokens": 60000}]
    assert [row["pool_tokens"] for row in rows] == [8000, 60000]
    assert rows[0]["evictions"] > 0 and rows[0]["hit_rate"] <= rows[1]["hit_rate"]
    (ref,) = doc["references"]
    assert ref["method"] == "replayed" and ref["pool_tokens"] >= doc["input_tokens"] and ref["page_size"] == 16
    assert ref["hit_rate"] >= rows[1]["hit_rate"] - 1e-9
    assert all(row["integrity_ok"] for row in rows)


def test_sweep_eviction_policies_human(mooncake_trace):
    result = invoke(mooncake_trace, "--block-size", 32, *SMALL, "--sweep", "cache.eviction_policy=lru,lfu",
                    "--jobs", 1, env={"NO_COLOR": "1"})
    assert result.exit_code == 0, result.stderr
    assert "lru" in result.stdout and "lfu" in result.stdout and "unlimited, ps 16 (replayed)" in result.stdout
    assert "…" not in result.stdout  # fits 120 columns


# -- plots ----------------------------------------------------------------------------------


def test_plot_without_matplotlib_is_bad_input(memcli_trace, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = invoke(memcli_trace, *SMALL, "--plot", tmp_path / "o.png")
    assert result.exit_code == 2
    assert "error: --plot needs matplotlib" in result.stderr and "hint: pip install 'memcli[plot]'" in result.stderr


def test_plot_writes_a_png_and_says_where(memcli_trace, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "o.png"
    result = invoke(memcli_trace, *SMALL, "--plot", out, "--json")
    assert result.exit_code == 0, result.stderr
    assert out.read_bytes()[:4] == b"\x89PNG" and f"plot: wrote {out}" in result.stderr


def test_occupancy_is_scaled_to_what_was_used():
    import numpy as np

    from memcli.tools.replay.plot import occupancy_scale

    series = {"time_ms": np.arange(3.0), "used_tokens": np.array([10, 900, 400]), "used_pages": np.array([1, 60, 30])}
    assert occupancy_scale(series, 4_194_304, 16) == (pytest.approx(1104.0), False)  # 60 pages of 16, +15 %
    assert occupancy_scale(series, 1000, 16) == (pytest.approx(1050.0), True)  # near the pool: the pool is drawn


def test_a_study_plot_draws_every_line(mooncake_trace, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "study.png"
    result = invoke(mooncake_trace, "--block-size", 32, *SMALL, "--sweep", "memory.max_total_tokens=8000,60000",
                    "--sweep", "cache.eviction_policy=lru,fifo", "--jobs", 1, "--plot", out, "--json")
    assert result.exit_code == 0, result.stderr
    assert out.read_bytes()[:4] == b"\x89PNG" and f"plot: wrote {out}" in result.stderr
    from memcli.tools.study.plot import study_lines

    x_key, categories, lines, ceilings = study_lines(json.loads(result.stdout))
    assert x_key == "memory.max_total_tokens" and categories == []
    assert [(line.label, line.xs, line.bound) for line in lines] == [
        ("eviction_policy=lru", [8000, 60000], False), ("eviction_policy=fifo", [8000, 60000], False),
        ("eviction_policy=belady (offline bound)", [8000, 60000], True)]
    assert [ps for ps, _ in ceilings] == [16]


def test_synthetic_head_replays(tmp_path):
    doc = run_json(SYNTHETIC, "--limit", 12, "--set", "memory.max_total_tokens=400000",
                   "--set", "memory.max_context_len=200000", "--set", "memory.max_running_requests=16")
    assert doc["summary"]["finished"] == 12 and doc["integrity"]["ok"]


def test_ignore_eos_requests_need_a_sharing_cache(tmp_path):
    """Requests marked ignore_eos replay on the radix tree; without prefix sharing SGLang
    admits them by a path memcli does not model, so the replay is refused (exit 2)."""
    path = tmp_path / "eos.jsonl"
    path.write_text('{"input_len": 40, "output_len": 5, "ignore_eos": true}\n{"input_len": 30, "output_len": 3}\n')
    ok = invoke(path, *SMALL, "--engine", "sglang-0.5.23", "--json")
    assert ok.exit_code == 0, ok.stderr
    refused = invoke(path, *SMALL, "--engine", "sglang-0.5.23", "--set", "cache.kind=chunk")
    assert refused.exit_code == 2 and "ignore_eos" in refused.stderr and "hint:" in refused.stderr
