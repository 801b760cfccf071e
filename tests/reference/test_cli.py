"""`memcli reference fetch` and `memcli reference diff` from the command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memcli.cli.app import app
from tests.test_json_envelope import assert_envelope

TRACE = "tests/data/conversation_head300.jsonl"
REPO = Path(__file__).resolve().parents[2]


def test_fetch_reports_the_cached_wheel(ref):
    result = CliRunner().invoke(app, ["reference", "fetch", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert_envelope(doc, "reference fetch", reads_config=False)
    assert doc["version"] == "0.5.5"
    assert doc["wheel"].endswith(".whl")


def test_diff_finds_no_divergent_step(ref):
    result = CliRunner().invoke(app, ["reference", "diff", TRACE, "--limit", "6", "--set", "memory.max_total_tokens=90000",
                                      "--set", "memory.max_context_len=88000", "--set", "scheduler.chunked_prefill_size=1024"])
    out = result.stdout
    assert result.exit_code == 0, out
    assert out.startswith("0 divergent steps in ")


def test_diff_runs_the_normal_loop_too(ref):
    result = CliRunner().invoke(app, ["reference", "diff", TRACE, "--limit", "6", "--set", "memory.max_total_tokens=90000",
                                      "--set", "memory.max_context_len=88000", "--set", "semantics.event_loop=normal"])
    out = result.stdout
    assert result.exit_code == 0, out
    assert out.startswith("0 divergent steps in ")


def test_diff_shows_the_memcli_profile_diverging(ref):
    # Chunked prefill: the memcli profile puts a chunk into the tree in the same step.
    result = CliRunner().invoke(app, ["reference", "diff", TRACE, "--limit", "6", "--set", "memory.max_total_tokens=90000",
                                      "--set", "memory.max_context_len=88000", "--set", "scheduler.chunked_prefill_size=1024",
                                      "--set", "semantics.profile=memcli"])
    out = result.stdout
    assert result.exit_code == 1, out
    assert "first divergent step:" in out and "sglang:" in out and "memcli:" in out


@pytest.mark.parametrize("args, named", [
    (["--set", "memory.page_size=3"], "memory.page_size"),
    (["--arrivals", "sequential"], "--arrivals sequential"),
    (["--set", "memory.max_context_len=1000"], "more than memory.max_context_len 1000"),
    (["--limit", "x"], "Invalid value for '--limit'"),
    (["--config", "/nonexistent/c.yaml"], "/nonexistent/c.yaml"),
])
def test_diff_bad_input_is_exit_2(ref, args, named):
    result = CliRunner().invoke(app, ["reference", "diff", TRACE, *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and named in result.stderr and "Traceback" not in result.stderr


def test_diff_timestamp_arrivals_need_arrival_times(ref, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"rid": "a", "input_len": 40, "output_len": 4}) + "\n")
    result = CliRunner().invoke(app, ["reference", "diff", str(trace), "--arrivals", "timestamp"])
    assert result.exit_code == 2, result.output
    assert "needs arrival times" in result.stderr and "hint: use --arrivals burst" in result.stderr


def test_diff_prints_one_json_document(ref):
    result = CliRunner().invoke(app, ["reference", "diff", TRACE, "--limit", "4", "--set", "memory.max_total_tokens=90000",
                                      "--set", "memory.max_context_len=88000", "--set", "scheduler.chunked_prefill_size=1024",
                                      "--set", "semantics.profile=memcli", "--json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 1
    assert list(doc)[:4] == ["command", "memcli_version", "profile", "config"]
    assert doc["command"] == "reference diff" and doc["profile"] == "memcli"
    assert doc["divergent"] is True and doc["first_divergence"]["fields"]
    assert doc["first_divergence"]["sglang"]["step"] == doc["first_divergence"]["step"]


# SGLang 0.5.5's host tier (the 0.5.23 reference runs no HiCache).
HOST_TIER = ["--engine", "sglang-0.5.5", "--set", "cache.kind=hiradix", "--set", "memory.max_total_tokens=90000",
             "--set", "memory.max_context_len=88000"]


def test_diff_runs_the_host_tier_and_says_how_copies_are_timed(ref):
    result = CliRunner().invoke(app, ["reference", "diff", TRACE, "--limit", "6", *HOST_TIER, "--json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 0, doc
    assert doc["divergent"] is False and doc["config"]["cache"]["kind"] == "hiradix"
    assert len(doc["notes"]) == 1 and "sim.host_bandwidth_gbps" in doc["notes"][0]


def test_diff_refuses_host_tier_settings_sglang_cannot_share(ref):
    for extra, named in ((["--set", "cache.host_size_gib=4"], "cache.host_size_gib"),
                         (["--set", "cache.load_back_threshold=32"], "load_back_threshold=10"),
                         (["--set", "cache.host_ratio=1.0", "--set", "semantics.host_pool_floor=any"],
                          "raise cache.host_ratio")):
        result = CliRunner().invoke(app, ["reference", "diff", TRACE, "--limit", "2", *HOST_TIER, *extra])
        err = result.stderr
        assert result.exit_code == 2, err
        assert "error:" in err and named in err and "Traceback" not in err


def test_diff_reports_a_side_that_raises_as_a_failure_not_a_traceback(ref, monkeypatch):
    """SGLang's own assertion (or memcli's guard) in the middle of a run ends the comparison
    with one `failed:` line naming the side and the step, and exit 1."""
    from memcli.reference import observe

    real_step = observe._step

    def failing(loop):
        if loop.step_count == 3:
            raise AssertionError("a check of SGLang's")
        return real_step(loop)

    monkeypatch.setattr(observe, "_step", failing)
    args = ["reference", "diff", TRACE, "--limit", "4", "--set", "memory.max_total_tokens=90000",
            "--set", "memory.max_context_len=88000", "--engine", "sglang-0.5.5"]  # 0.5.5's loop, stepped here
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "failed: SGLang's loop raised at step 3: AssertionError: a check of SGLang's" in result.stdout
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["failure"].startswith("SGLang's loop raised at step 3") and doc["divergent"] is False


def _memcli_raises_at_step_2(monkeypatch) -> None:
    """memcli's side of a side-by-side run raises an IndexError at its step 2."""
    from memcli.reference import observe

    real_step = observe.MemcliSide.step

    def failing(self):
        if self.scheduler.step_count == 2:
            raise IndexError("a bug of memcli's")
        return real_step(self)

    monkeypatch.setattr(observe.MemcliSide, "step", failing)


def test_diff_names_memcli_when_its_scheduler_raises(ref, monkeypatch):
    _memcli_raises_at_step_2(monkeypatch)
    result = CliRunner().invoke(app, ["reference", "diff", TRACE, "--limit", "4", "--set", "memory.max_total_tokens=90000",
                                      "--set", "memory.max_context_len=88000", "--engine", "sglang-0.5.5"])
    assert result.exit_code == 1, result.output
    assert "failed: memcli's scheduler raised at step 2: IndexError: a bug of memcli's (test_cli.py:" in result.stdout


# The Triton interpreter is chosen in-process, before either side's kernels are decorated: a
# fresh interpreter that never set TRITON_INTERPRET runs the diff with memcli's Triton kernels
# too (interpreted on a CPU), and prints one JSON document.
PROBE = """
import sys
from memcli.cli.app import app
app(sys.argv[1:], prog_name="memcli")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without CUDA")
def test_diff_chooses_the_triton_interpreter_in_process(ref):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [TRACE, "--limit", "3", "--set", "memory.max_total_tokens=90000", "--set", "memory.max_context_len=88000",
            "--set", "runtime.kernel_backend=triton", "--json"]
    proc = subprocess.run([sys.executable, "-c", PROBE, "reference", "diff", *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["divergent"] is False and doc["failure"] is None and doc["config"]["runtime"]["kernel_backend"] == "triton"


def test_reference_diff_writes_both_step_logs_and_they_match_the_replays(ref, tmp_path):
    mine, theirs, replayed = tmp_path / "memcli.jsonl", tmp_path / "sglang.jsonl", tmp_path / "replay.jsonl"
    trace = "tests/data/conversation_head300.jsonl"
    # The step logs of both sides: an engine whose harness observes steps (sglang-0.5.5).
    result = CliRunner().invoke(app, ["reference", "diff", trace, "--limit", "12", "--steps-out", str(mine),
                                      "--reference-steps-out", str(theirs), "--engine", "sglang-0.5.5"])
    assert result.exit_code == 0, result.output
    assert "step logs (A: the engine's own code, B: memcli):" in result.output and "equal:" in result.output
    replay = CliRunner().invoke(app, ["replay", trace, "--limit", "12", "--arrivals", "burst",
                                      "--steps-out", str(replayed), "--engine", "sglang-0.5.5"])
    assert replay.exit_code == 0, replay.output
    # memcli's side of the harness and the replay write the same log; SGLang's side equals it too.
    assert mine.read_text() == replayed.read_text() and len(mine.read_text().splitlines()) > 10
    assert CliRunner().invoke(app, ["diff", str(theirs), str(mine)]).exit_code == 0
    # The --json document carries the same comparison, in memcli diff's fields.
    doc = json.loads(CliRunner().invoke(app, ["reference", "diff", trace, "--limit", "12", "--json",
                                              "--engine", "sglang-0.5.5"]).stdout)
    logs = doc["step_logs"]
    assert logs["a"] == "the engine's own code" and logs["b"] == "memcli"
    assert logs["equal"] is True and logs["first_divergence"] is None
    assert logs["steps_a"] == logs["steps_b"] == len(mine.read_text().splitlines())
    assert logs["cached_tokens"]["a"] == logs["cached_tokens"]["b"] > 0


# SGLang 0.5.23's reference runs whole in its worker process; memcli steps beside its steps.
V0523 = ["--engine", "sglang-0.5.23"]


def test_reference_diff_0523_writes_both_step_logs_and_they_match_the_replay(worker0523, tmp_path):
    mine, theirs, replayed = tmp_path / "memcli.jsonl", tmp_path / "sglang.jsonl", tmp_path / "replay.jsonl"
    result = CliRunner().invoke(app, ["reference", "diff", TRACE, "--limit", "8", "--steps-out", str(mine),
                                      "--reference-steps-out", str(theirs), "--json", *V0523])
    assert result.exit_code == 0, result.output
    replay = CliRunner().invoke(app, ["replay", TRACE, "--limit", "8", "--arrivals", "burst",
                                      "--steps-out", str(replayed), *V0523])
    assert replay.exit_code == 0, replay.output
    # memcli's side of the harness writes the replay's log; SGLang 0.5.23's side, built from
    # the worker's observations, equals it too.
    assert mine.read_text() == replayed.read_text() and len(mine.read_text().splitlines()) > 10
    assert CliRunner().invoke(app, ["diff", str(theirs), str(mine)]).exit_code == 0
    logs = json.loads(result.stdout)["step_logs"]
    assert logs["a"] == "the engine's own code" and logs["b"] == "memcli"
    assert logs["equal"] is True and logs["first_divergence"] is None
    assert logs["steps_a"] == logs["steps_b"] == len(theirs.read_text().splitlines())
    assert logs["cached_tokens"]["a"] == logs["cached_tokens"]["b"] > 0


def test_reference_diff_0523_step_logs_show_the_divergence(worker0523, tmp_path):
    """Under the memcli profile the sides diverge; the two logs written differ too."""
    mine, theirs = tmp_path / "memcli.jsonl", tmp_path / "sglang.jsonl"
    result = CliRunner().invoke(app, ["reference", "diff", TRACE, "--limit", "6", "--set", "memory.max_total_tokens=90000",
                                      "--set", "memory.max_context_len=88000", "--set", "scheduler.chunked_prefill_size=1024",
                                      "--set", "semantics.profile=memcli", "--steps-out", str(mine),
                                      "--reference-steps-out", str(theirs), *V0523])
    assert result.exit_code == 1, result.output
    assert "first divergent step:" in result.stdout and "step logs (A: the engine's own code, B: memcli):" in result.stdout
    assert mine.read_text() != theirs.read_text()
    assert CliRunner().invoke(app, ["diff", str(theirs), str(mine)]).exit_code == 1


class _BadTokenWorker:
    """The real 0.5.23 worker, sent request 10 (arriving at 3 s) with a token SGLang's loop
    cannot take: its loop raises in the step that request arrives in, mid-run (memcli's side
    runs the trace as is)."""

    def __init__(self, worker):
        self.worker = worker

    def call(self, task, **args):
        if task == "replay":
            args["requests"][10][1][-1] = "not a token"
        return self.worker.call(task, **args)

    def close(self):  # the fixture's worker, closed by the fixture
        pass


def test_diff_0523_reports_sglang_raising_as_a_failure_not_a_traceback(worker0523, monkeypatch):
    from memcli.reference.v0523 import client

    monkeypatch.setattr(client, "Worker0523", lambda: _BadTokenWorker(worker0523))
    monkeypatch.delenv("MEMCLI_DEBUG", raising=False)
    args = ["reference", "diff", TRACE, "--limit", "12", "--arrivals", "timestamp", *V0523]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    line = next(line for line in result.stdout.splitlines() if line.startswith("failed: "))
    assert line.startswith("failed: SGLang's loop raised at step ") and "TypeError" in line and "(loop.py:" in line
    step = int(line.split("raised at step ")[1].split(":")[0])
    assert step > 10 and f"{step} steps compared before it" in result.stdout
    doc = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert doc["failure"] == line.removeprefix("failed: ") and doc["divergent"] is False and doc["steps"] == step
    monkeypatch.setenv("MEMCLI_DEBUG", "1")  # the worker's error, raised here
    result = CliRunner().invoke(app, args)
    assert result.exception is not None and "TypeError" in str(result.exception)


def test_diff_0523_names_memcli_when_its_scheduler_raises(worker0523, monkeypatch):
    _memcli_raises_at_step_2(monkeypatch)
    monkeypatch.delenv("MEMCLI_DEBUG", raising=False)
    args = ["reference", "diff", TRACE, "--limit", "6", *V0523]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "failed: memcli's scheduler raised at step 2: IndexError: a bug of memcli's (test_cli.py:" in result.stdout
    assert "2 steps compared before it" in result.stdout
    monkeypatch.setenv("MEMCLI_DEBUG", "1")
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, IndexError)
