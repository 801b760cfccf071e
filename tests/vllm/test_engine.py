"""Engine `vllm-0.33` through the seam: replay runs on it, and bad input exits 2 with a hint."""

import json

import pytest
from typer.testing import CliRunner

from memcli import engines
from memcli.cli.app import app
from memcli.config import Config, load_config

TRACE = "tests/data/conversation_head300.jsonl"
SYNC = []


def test_the_engine_is_registered():
    assert "vllm-0.33" in engines.names()


def test_replay_runs_under_vllm_and_frees_everything():
    result = CliRunner().invoke(app, ["replay", TRACE, "--limit", "40", "--engine", "vllm-0.33", *SYNC, "--json",
                                      "--set", "memory.max_context_len=131072", "--set", "memory.max_total_tokens=200000"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["summary"]["finished"] == 40
    assert doc["integrity"]["everything_free_at_end"]
    assert doc["config"]["semantics"]["engine"] == "vllm-0.33"


@pytest.mark.parametrize("setting, message", [
    ("memory.page_size=8", "multiples of 16"),
    ("cache.kind=hiradix", "no host tier"),
    ("cache.eviction_policy=lfu", "free-block queue"),
    ("semantics.event_loop=overlap", "SGLang's loop"),
    ("scheduler.policy=lpm", "no lpm policy"),
])
def test_what_vllm_lacks_is_refused(setting, message):
    result = CliRunner().invoke(app, ["replay", TRACE, "--limit", "2", "--engine", "vllm-0.33", *SYNC, "--set", setting])
    assert result.exit_code == 2, result.output
    assert message in result.output and "hint:" in result.output and "Traceback" not in result.output


def test_priority_policy_is_vllms_only():
    result = CliRunner().invoke(app, ["replay", TRACE, "--limit", "2", "--engine", "sglang-0.5.5",
                                      "--set", "scheduler.policy=priority"])
    assert result.exit_code == 2, result.output
    assert "priority is vLLM's policy" in result.output and "hint:" in result.output


def _priority_order(policy: str) -> list[str]:
    """The order four requests are served in, one running at a time, under `policy`."""
    from memcli.steps import SchedulerHooks

    config = load_config(overrides=["semantics.engine=vllm-0.33", f"scheduler.policy={policy}",
                                    "scheduler.max_num_seqs=1", "memory.max_total_tokens=4096",
                                    "memory.max_context_len=4096"])
    engine = engines.get(config)
    sched = engine.scheduler(engine.build_stack(config).memory, config, SchedulerHooks())
    for rid, priority in (("a", 0), ("b", 2), ("c", -1), ("d", 0)):
        sched.add_request(sched.new_req(rid, list(range(40)), 2, None, 0.0, priority=priority))
    while not sched.is_done():
        sched.step()
    return [r.rid for r in sched.finished]  # one at a time: finished in the order admitted


def test_priority_policy_orders_the_waiting_queue():
    assert _priority_order("fcfs") == ["a", "b", "c", "d"]
    assert _priority_order("priority") == ["c", "a", "d", "b"]


def test_vllm_keys_stay_out_of_documents_while_unset():
    assert "max_num_seqs" not in Config().to_dict()["scheduler"]
    config = load_config(overrides=["scheduler.max_num_seqs=4"])
    assert config.to_dict()["scheduler"]["max_num_seqs"] == 4


def test_reference_diff_runs_vllms_own_scheduler(vllm_ref):
    result = CliRunner().invoke(app, ["reference", "diff", TRACE, "--limit", "12", "--engine", "vllm-0.33", "--json",
                                      "--set", "memory.max_context_len=131072", "--set", "memory.max_total_tokens=200000"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["divergent"] is False and doc["steps"] > 12 and doc["event_loop"] == "async" and doc["failure"] is None
    assert doc["profile"] == "vllm-0.33 (async loop)"


@pytest.mark.parametrize("command", [["check-page-size", "--steps", "0"],
                                     ["bench-one-batch", "-b", "1", "--input-len", "40", "--output-len", "2",
                                      "--repeat", "1", "--warmup", "0", "--rounds", "1"]])
def test_check_page_size_and_bench_one_batch_run_vllm(command):
    # Their vLLM paths: tests/tools/check_page_size/test_vllm_blocks.py, tests/tools/bench_one_batch/test_vllm_bench.py.
    result = CliRunner().invoke(app, [*command, "--engine", "vllm-0.33"])
    assert result.exit_code == 0, result.output


def test_show_config_prints_vllms_blocks():
    result = CliRunner().invoke(app, ["show-config", "--engine", "vllm-0.33", "--json",
                                      "--set", "memory.max_total_tokens=160000"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["derived"]["num_gpu_blocks"] == 10_000 and doc["derived"]["usable_blocks"] == 9_999
    assert doc["semantics_in_force"]["event_loop"] == "async" and doc["config"]["memory"]["page_size"] == 16


def test_the_step_log_and_the_timeline_of_a_vllm_run_add_up_to_its_document(tmp_path):
    """The engine fills the engine-neutral step records (batches, events), so the step log
    and the timeline are what they are for SGLang: checked here against the run's own document
    on a pool small enough to preempt and evict."""
    steps, timeline = tmp_path / "steps.jsonl", tmp_path / "timeline.json"
    result = CliRunner().invoke(app, ["replay", "tests/data/conversation_head300.jsonl", "--engine", "vllm-0.33",
                                      "--limit", "80", "--arrivals", "burst", "--set", "memory.max_total_tokens=90000",
                                      "--set", "memory.max_context_len=88000", "--json", "--steps-out", str(steps),
                                      "--timeline", str(timeline)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    log = [json.loads(line) for line in steps.read_text().splitlines()]
    assert len(log) == doc["summary"]["steps"]
    first: dict[str, int] = {}  # a request's first admission (the document counts those; re-admissions hit again)
    for s in log:
        for e in s["requests"]:
            first.setdefault(e["rid"], e["cached"])
    assert sum(first.values()) == doc["cached_tokens"] > 0
    assert sum(e["cached"] for s in log for e in s["requests"]) > doc["cached_tokens"]  # preempted ones re-hit
    assert sum(len(s["finished"]) for s in log) == doc["summary"]["finished"] == 80
    assert sum(len(s["retracted"]) for s in log) == doc["scheduling"]["retracted_requests"] > 0
    assert sum(s["evicted_tokens"] for s in log) == doc["eviction"]["tokens_evicted"] > 0
    pool = doc["allocation"]["pool_tokens"]
    assert all(s["used"] + s["evictable"] + s["protected"] + s["free"] == pool for s in log)
    events = json.loads(timeline.read_text())["traceEvents"]
    begun = [e for e in events if e["ph"] == "b" and e["name"].startswith("request ")]
    ended = [e for e in events if e["ph"] == "e" and e["name"].startswith("request ")]
    assert len(begun) == len(ended) == 80


def test_reference_diff_refuses_step_logs_its_harness_does_not_observe(tmp_path):
    result = CliRunner().invoke(app, ["reference", "diff", "tests/data/conversation_head300.jsonl", "--engine",
                                      "vllm-0.33", "--limit", "3", "--steps-out", str(tmp_path / "s.jsonl")])
    assert result.exit_code == 2
    assert "not step logs" in result.output and "memcli replay TRACE --engine vllm-0.33" in result.output
    assert not (tmp_path / "s.jsonl").exists()


def test_vllm_rejects_prompts_of_max_model_len_and_stops_outputs_there(tmp_path):
    """vLLM's input processor rejects a prompt of max_model_len tokens or more; a request stops
    when its tokens reach max_model_len. The rule lists exactly what the scheduler does."""
    from memcli.tools.replay.runner import ReplayOptions, replay as run
    from memcli.workload.readers import read_trace

    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"rid": f"r{i}", "input_len": n, "output_len": m}) + "\n"
                            for i, (n, m) in enumerate([(40, 8), (4000, 200), (4096, 2), (30, 4), (5000, 1)])))
    sets = ["memory.max_context_len=4096", "memory.max_total_tokens=8192", "memory.kv_budget_gib=null"]
    result = CliRunner().invoke(app, ["replay", str(path), "--engine", "vllm-0.33", "--arrivals", "burst", "--json",
                                      *[x for s in sets for x in ("--set", s)]])
    assert result.exit_code == 0, result.output
    limits = json.loads(result.stdout)["limits"]
    assert [(r["rid"], r["line"], r["action"], r["kept_output_len"]) for r in limits["requests"]] == [
        ("r1", 2, "clipped", 96), ("r2", 3, "aborted", 0), ("r4", 5, "aborted", 0)]
    out = run(load_config(None, sets + ["semantics.engine=vllm-0.33"]), read_trace(str(path)), ReplayOptions("burst"))
    assert out.requests_log.aborted.tolist() == [False, False, True, False, True]
    assert out.requests_log.output_tokens.tolist() == [8, 96, 0, 4, 0]
    strict = CliRunner().invoke(app, ["replay", str(path), "--engine", "vllm-0.33", "--strict-limits",
                                      *[x for s in sets for x in ("--set", s)]])
    assert strict.exit_code == 2


def test_replay_reads_the_traces_priorities(tmp_path):
    trace = tmp_path / "p.jsonl"
    rows = [{"rid": rid, "input_len": 40, "output_len": 2, "priority": p} for rid, p in (("a", 3), ("b", 0), ("c", -2))]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(app, ["replay", str(trace), "--engine", "vllm-0.33", "--arrivals", "burst",
                                      "--requests-out", str(out), "--set", "scheduler.policy=priority",
                                      "--set", "scheduler.max_num_seqs=1", "--set", "memory.max_total_tokens=4096",
                                      "--set", "memory.max_context_len=4096"])
    assert result.exit_code == 0, result.output
    admitted = {r["rid"]: r["admission_ms"] for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(admitted, key=admitted.get) == ["c", "b", "a"]


def test_show_config_sizes_the_pool_as_vllm_does():
    """num_gpu_blocks = available_memory // bytes_per_block (vLLM's kv_cache_planning), with
    memory.kv_budget_gib as --kv-cache-memory-bytes; the GPU share at gpu_memory_utilization."""
    import json

    from typer.testing import CliRunner

    from memcli.cli.app import app

    out = CliRunner().invoke(app, ["show-config", "--engine", "vllm-0.33", "--json", "--set", "memory.kv_budget_gib=1.3",
                                   "--set", "memory.max_total_tokens=null"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    sizes = next(v for k, v in doc.items() if isinstance(v, dict) and "bytes_per_block" in v)
    assert sizes["bytes_per_block"] == sizes["block_size"] * sizes["bytes_per_token"]
    assert sizes["num_gpu_blocks"] == int(1.3 * 2**30) // sizes["bytes_per_block"]
    assert sizes["kv_cache_bytes"] == sizes["num_gpu_blocks"] * sizes["bytes_per_block"]
    assert sizes["gpu_memory_utilization"] == 0.92
    assert abs(sizes["gpu_gib_for_this_kv_cache"] * 0.92 * 2**30 - sizes["kv_cache_bytes"]) < 2**30 / 1000
