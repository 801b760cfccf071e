"""The fast path (steady decode runs taken at once, `memcli.sched.decode_run`) against the
plain loop (`memcli replay --plain-loop`): the same document, step log and request rows, on
the bundled traces, for every engine and event loop, page sizes 1 and 16, radix and hiradix,
pools that force eviction and retraction, with and without per-step checks (the incremental
check covers runs too; the full walk every step leaves every step to the plain loop)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.config import load_config
from memcli.sched import decode_run
from memcli.tools.replay.ceiling import shared_prefix_lens
from memcli.tools.replay.runner import ReplayOptions, default_arrivals, replay
from memcli.workload.readers import read_trace

DATA = Path(__file__).resolve().parents[1] / "data"
CONVERSATION = DATA / "conversation_head300.jsonl"
SYNTHETIC = DATA / "synthetic_head200.jsonl"
SMALL = ["--set", "memory.max_context_len=40000", "--set", "memory.max_total_tokens=60000",
         "--set", "memory.max_running_requests=16"]
WALL = ("wall", "per_s", "check_s")  # wall-clock fields: the only ones allowed to differ

# (name, trace, arguments, whether the fast path takes runs there)
CASES = [
    ("0.5.23", CONVERSATION, ["--engine", "sglang-0.5.23"], True),
    ("0.5.23 small pool", CONVERSATION, ["--engine", "sglang-0.5.23", *SMALL], True),
    ("0.5.23 ps16", CONVERSATION, ["--engine", "sglang-0.5.23", "--set", "memory.page_size=16"], True),
    ("0.5.23 ps16 small pool", CONVERSATION, ["--engine", "sglang-0.5.23", "--set", "memory.page_size=16", *SMALL],
     True),
    ("0.5.5 ps4 small pool", SYNTHETIC, ["--engine", "sglang-0.5.5", "--set", "memory.page_size=4", *SMALL], True),
    ("0.5.23 normal loop", CONVERSATION, ["--engine", "sglang-0.5.23", "--set", "semantics.event_loop=normal"], False),
    ("0.5.23 hiradix", CONVERSATION, ["--engine", "sglang-0.5.23", "--set", "cache.kind=hiradix"], True),
    ("0.5.23 hiradix write_back small pool", CONVERSATION, ["--engine", "sglang-0.5.23", "--set", "cache.kind=hiradix",
                                                            "--set", "cache.write_policy=write_back", *SMALL], True),
    ("0.5.5 hiradix ps16", CONVERSATION, ["--engine", "sglang-0.5.5", "--set", "cache.kind=hiradix",
                                          "--set", "memory.page_size=16"], True),
    ("0.5.23 checked", CONVERSATION, ["--engine", "sglang-0.5.23", "--check", *SMALL], True),
    ("0.5.23 ps16 checked", CONVERSATION, ["--engine", "sglang-0.5.23", "--check", "--set", "memory.page_size=16"],
     True),
    ("0.5.5 hiradix ps4 checked", SYNTHETIC, ["--engine", "sglang-0.5.5", "--check", "--set", "cache.kind=hiradix",
                                              "--set", "memory.page_size=4", *SMALL], True),
    ("0.5.23 full walk every step", SYNTHETIC, ["--engine", "sglang-0.5.23", "--check", "full", *SMALL], False),
    ("0.5.23 lfu", SYNTHETIC, ["--engine", "sglang-0.5.23", "--set", "cache.eviction_policy=lfu", *SMALL], True),
    ("0.5.5", CONVERSATION, ["--engine", "sglang-0.5.5"], True),
    ("0.5.5 small pool", CONVERSATION, ["--engine", "sglang-0.5.5", *SMALL], True),
    ("0.5.5 normal loop hiradix", CONVERSATION, ["--engine", "sglang-0.5.5", "--set", "semantics.event_loop=normal",
                                                 "--set", "cache.kind=hiradix"], False),
    ("0.5.5 hiradix small pool", CONVERSATION, ["--engine", "sglang-0.5.5", "--set", "cache.kind=hiradix", *SMALL],
     True),
    ("memcli profile", CONVERSATION, ["--set", "semantics.profile=memcli"], False),  # the normal loop
    ("memcli profile, overlap", CONVERSATION, ["--set", "semantics.profile=memcli", "--set",
                                               "semantics.event_loop=overlap"], True),
    ("vllm-0.33", CONVERSATION, ["--engine", "vllm-0.33", *SMALL, "--set", "memory.page_size=32"], False),
]


def _strip(doc):
    if isinstance(doc, dict):
        return {k: _strip(v) for k, v in doc.items() if not any(w in k for w in WALL)}
    if isinstance(doc, list):
        return [_strip(v) for v in doc]
    return doc


def _replay(trace: Path, args: list, out: Path | None, plain: bool) -> dict:
    """The replay's document; with `out`, its step log and request rows are written there (the
    step log takes every step's record on its own: without it a run's records come as columns)."""
    files = []
    if out is not None:
        out.mkdir()
        files = ["--steps-out", str(out / "steps.jsonl"), "--requests-out", str(out / "requests.csv")]
    result = CliRunner().invoke(app, ["replay", str(trace), *args, "--json", *files,
                                      *(["--plain-loop"] if plain else [])])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("name, trace, args, runs", CASES, ids=[c[0] for c in CASES])
def test_the_fast_path_leaves_what_the_plain_loop_leaves(name, trace, args, runs, tmp_path, monkeypatch):
    taken = []
    take = decode_run.DecodeRuns.take
    monkeypatch.setattr(decode_run.DecodeRuns, "take", lambda self, *a: taken.append(take(self, *a)) or taken[-1])
    plain = _replay(trace, args, tmp_path / "plain", plain=True)
    assert not taken  # the plain loop never takes a run
    fast = _replay(trace, args, tmp_path / "fast", plain=False)
    assert _strip(fast) == _strip(plain)
    assert _strip(_replay(trace, args, None, plain=False)) == _strip(plain)  # the runs' records as columns
    for name in ("steps.jsonl", "requests.csv"):
        assert (tmp_path / "fast" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
    if runs:  # the comparison covered runs: most decode steps were taken in them
        assert sum(taken) >= fast["summary"]["decode_steps"] // 2 and min(taken) >= 1
    else:
        assert not taken


def test_long_runs_stop_at_arrivals_finishes_and_the_run_limit(tmp_path, monkeypatch):
    # Long outputs and arrivals far apart: runs as long as the run limit, cut by each arrival
    # and by the first finish of a batch.
    rows = [{"timestamp": 4000 * i, "input_length": 600 + 37 * i, "output_length": 900 + 61 * (i % 5),
             "hash_ids": [0, 100 + i]} for i in range(12)]
    trace = tmp_path / "long.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    taken = []
    take = decode_run.DecodeRuns.take
    monkeypatch.setattr(decode_run.DecodeRuns, "take", lambda self, *a: taken.append(take(self, *a)) or taken[-1])
    monkeypatch.setattr("memcli.tools.replay.runner.MAX_RUN_STEPS", 64)
    plain = _replay(trace, [], tmp_path / "plain", plain=True)
    fast = _replay(trace, [], tmp_path / "fast", plain=False)
    assert _strip(fast) == _strip(plain)
    assert (tmp_path / "fast" / "steps.jsonl").read_bytes() == (tmp_path / "plain" / "steps.jsonl").read_bytes()
    assert max(taken) == 64 and sum(taken) > 0.9 * fast["summary"]["decode_steps"]


@pytest.mark.parametrize("args", [[], ["memory.page_size=16"], SMALL[1::2], ["cache.kind=hiradix"]],
                         ids=["ps1", "ps16", "small pool", "hiradix"])
def test_a_runs_records_as_columns_are_the_plain_loops_steps(args, monkeypatch):
    # Without a step log the runs hand their records over as columns (`StepRun`): the replay's
    # step series (every field of every step) must be the plain loop's, number for number.
    from memcli.tools.replay import runner

    columns = []
    extend = runner.StepSeries.extend
    monkeypatch.setattr(runner.StepSeries, "extend", lambda self, run: columns.append(len(run.time_ms))
                        or extend(self, run))
    last: dict = {}  # per replay, the scheduler's last record after each loop iteration, by step
    after = runner._Run._after_step

    def record(run):
        last.setdefault(run.options.plain_loop, {})[run.scheduler.step_count] = run.scheduler.records[-1]
        after(run)

    monkeypatch.setattr(runner._Run, "_after_step", record)
    trace = read_trace(CONVERSATION, limit=120)
    config = load_config(None, [*args, "semantics.engine=sglang-0.5.23"], builtin="replay")
    results = {plain: replay(config, trace, ReplayOptions(default_arrivals(trace), plain_loop=plain), None,
                             shared_prefix_lens(trace)) for plain in (True, False)}
    assert sum(columns) >= results[False].summary.decode_steps // 2  # most decode steps came as columns
    plain, fast = results[True].series, results[False].series
    assert fast.keys() == plain.keys()
    for name, values in plain.items():
        assert np.array_equal(fast[name], values), name
    for step, record in last[False].items():  # a run leaves its last step's record, as the plain loop
        assert record == last[True][step], step


def _state(sched) -> tuple:
    """What the loop leaves after a step: clock, ratio, counters, the batches in flight, the
    running requests' records and rows, the free list."""
    memory, loop = sched.memory, sched.overlap
    table = memory.req_to_token_pool.req_to_token
    running = tuple((r.rid, len(r.output_ids), hash(tuple(r.output_ids)), r.kv.kv_allocated_len,
                     r.kv.kv_committed_len, r.kv.last_matched_prefix_len, _digest(r.kv.prefix_indices),
                     _digest(table[r.kv.req_pool_idx, : r.kv.kv_allocated_len]))
                    for r in sched.running.reqs)
    flights = tuple((f.kind, tuple(r.rid for r in f.reqs), tuple(f.seq_lens), tuple(f.tokens), len(f.extra))
                    for f in loop.result_queue)
    allocator, host = memory.allocator, memory.host_tier()
    stats = sched.stats
    host_state = None if host is None else (host.used, host.d2h_bytes, host.h2d_bytes, sched._host_seen)
    return (sched.clock_ms, sched.new_token_ratio, sched.next_token, stats.decode_steps, stats.allocations,
            stats.allocated_tokens, loop.last_kind, flights, running, sched.running.seq_lens_cpu.tolist(),
            sched.running.seq_lens.tolist(), sched.running.req_pool_indices.tolist(), allocator.free_head,
            _digest(allocator._free_list()), memory.usage(), sched.gate.full, sched.progress_guard.stalled_steps,
            host_state)


def _digest(tensor) -> bytes:
    return hashlib.sha1(tensor.contiguous().numpy().tobytes()).digest()


@pytest.mark.parametrize("args", [["--engine", "sglang-0.5.23"], ["--engine", "sglang-0.5.5"],
                                  ["--engine", "sglang-0.5.23", "--set", "cache.eviction_policy=lfu"],
                                  ["--engine", "sglang-0.5.23", "--set", "memory.page_size=16"],
                                  ["--engine", "sglang-0.5.5", "--set", "memory.page_size=8"],
                                  ["--engine", "sglang-0.5.23", "--set", "cache.kind=hiradix"],
                                  ["--engine", "sglang-0.5.5", "--set", "cache.kind=hiradix"]],
                         ids=["0.5.23", "0.5.5", "0.5.23 lfu", "0.5.23 ps16", "0.5.5 ps8", "0.5.23 hiradix",
                              "0.5.5 hiradix"])
def test_after_every_run_the_state_is_the_plain_loops(args, monkeypatch):
    # After each run (and each plain step) the whole loop state is recorded by step; the
    # fast replay's states must be the plain replay's at the same steps.
    from memcli.tools.replay import runner

    states: dict = {}
    after = runner._Run._after_step

    def record(run):
        states.setdefault(run.options.plain_loop, {})[run.scheduler.step_count] = _state(run.scheduler)
        after(run)

    monkeypatch.setattr(runner._Run, "_after_step", record)
    for plain in (True, False):
        result = CliRunner().invoke(app, ["replay", str(CONVERSATION), *args, *SMALL, "--limit", "100", "--json",
                                          *(["--plain-loop"] if plain else [])])
        assert result.exit_code == 0, result.output
    fast, slow = states[False], states[True]
    assert len(fast) < 0.6 * len(slow)  # runs were taken: fewer states recorded
    for step, state in fast.items():
        assert state == slow[step], f"step {step}"


def test_a_run_starts_only_where_every_row_holds_its_prompt_and_outputs(monkeypatch):
    # `steady` reads each request's room from its row length: it may only do so where the
    # row holds the prompt and every output but the one in flight, and then the room is the
    # one counted from the outputs (by length and by EOS), and the page estimate exact. A
    # request may finish inside the run only by length, at the iteration after its room, and
    # never the batch's last request.
    seen, absorbed = [], []
    steady = decode_run.DecodeRuns.steady

    def checked(self, limit):
        steps = steady(self, limit)
        if steps:
            batch, ps = self.sched.running, self.sched.page_size
            lengths = batch.seq_lens_cpu.tolist()
            outs = [len(r.output_ids) for r in batch.reqs]
            assert lengths == [r.input_len + n for r, n in zip(batch.reqs, outs)]
            rooms = [min(r.max_new_tokens, r.eos_len if r.eos_len > n else r.max_new_tokens) - n - 1
                     for r, n in zip(batch.reqs, outs)]
            leave_at = self._leave_at
            inside = {} if leave_at is None else {id(r): int(j) for r, j in zip(batch.reqs, leave_at) if j}
            for r, n, room in zip(batch.reqs, outs, rooms):
                if room < steps:  # finishes inside the run: by length, where the plan says
                    assert n + room + 1 == r.max_new_tokens and inside.get(id(r)) == room + 1
                    absorbed.append(r.rid)
                else:
                    assert id(r) not in inside
            assert len(inside) < len(batch.reqs)
            assert [(r.input_len + n) % ps == 0 for r, n in zip(batch.reqs, outs)] == [x % ps == 0 for x in lengths]
            seen.append(steps)
        return steps

    monkeypatch.setattr(decode_run.DecodeRuns, "steady", checked)
    for args in (["--set", "memory.page_size=16"], SMALL, ["--engine", "sglang-0.5.5", *SMALL]):
        result = CliRunner().invoke(app, ["replay", str(CONVERSATION), *args, "--limit", "150", "--json"])
        assert result.exit_code == 0, result.output
    assert len(seen) > 100 and absorbed  # 0.5.23's runs took finishes in


def _swap(table, rows, positions) -> None:
    """Two rows' slots at their positions, exchanged (a decode write gone wrong)."""
    (a, b), (la, lb) = rows, positions
    table[a, la], table[b, lb] = table[b, lb], table[a, la]


def _checked_failure(args: list, tmp_path, plain: bool) -> dict:
    result = CliRunner().invoke(app, ["replay", str(CONVERSATION), *args, "--check", "--json",
                                      *(["--plain-loop"] if plain else [])])
    assert result.exit_code == 1, result.output
    integrity = json.loads(result.stdout)["integrity"]
    assert not integrity["ok"]
    return integrity


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_slot_written_wrong_inside_a_run_is_found_at_its_step_as_by_the_plain_loop(page_size, tmp_path,
                                                                                    monkeypatch):
    # The fast path under --check: the first run of three steps or more writes two rows' slots
    # of its second step swapped. The plain loop is then broken the same way at that step: both
    # must stop at that step, by the same check, with the same message and the same history.
    from memcli.mem_cache import allocator

    args = ["--engine", "sglang-0.5.23", "--set", f"memory.page_size={page_size}", *SMALL]
    cls = allocator.TokenToKVPoolAllocator if page_size == 1 else allocator.PagedTokenToKVPoolAllocator
    run_write, step_write = cls.alloc_decode_run_write, cls.alloc_decode_write
    broken = {}

    def wrong_run(self, seq_lens_cpu, req_pool_indices, req_to_token, opened, observe=None):
        first = self.ledger.step
        out = run_write(self, seq_lens_cpu, req_pool_indices, req_to_token, opened, observe)
        if not broken and len(opened) >= 3 and seq_lens_cpu.numel() >= 2:
            rows = req_pool_indices.numpy()[:2].tolist()
            broken.update(step=first + 1, rows=rows)
            _swap(req_to_token.numpy(), rows, (seq_lens_cpu.numpy()[:2] + 1).tolist())
        return out

    monkeypatch.setattr(cls, "alloc_decode_run_write", wrong_run)
    fast = _checked_failure(args, tmp_path, plain=False)
    expected = "page_sharing" if page_size == 1 else "row_layout"  # a paged row's slot off its page's run
    assert broken and fast["failure_step"] == broken["step"] and fast["failure_check"] == expected

    def wrong_step(self, seq_lens, seq_lens_cpu, req_pool_indices, req_to_token, *rest, **kw):
        out = step_write(self, seq_lens, seq_lens_cpu, req_pool_indices, req_to_token, *rest, **kw)
        if self.ledger.step == broken["step"]:
            rows = req_pool_indices.numpy().tolist()
            at = [rows.index(r) for r in broken["rows"]]
            _swap(req_to_token.numpy(), broken["rows"], seq_lens_cpu.numpy()[at].tolist())
        return out

    monkeypatch.setattr(cls, "alloc_decode_run_write", run_write)
    monkeypatch.setattr(cls, "alloc_decode_write", wrong_step)
    plain = _checked_failure(args, tmp_path, plain=True)
    for key in ("failure_step", "failure_check", "failure", "history"):
        assert fast[key] == plain[key], key


def test_a_count_gone_wrong_inside_a_run_names_the_run(tmp_path, monkeypatch):
    # A run whose allocator moves the free list's head one page too far: the pages are lost,
    # which the check after the run finds, naming the run's steps (no position tells which).
    from memcli.mem_cache import allocator

    cls = allocator.TokenToKVPoolAllocator
    took = cls._took_run
    runs = []

    def lose_one(self, slots, opened, observe):
        took(self, slots, opened, observe)
        if not runs:
            runs.append((self.ledger.step, len(opened)))
            self._advance(1)  # one page out of the free list, told to the ledger, claimed by nobody
            self._commit_alloc(1)

    monkeypatch.setattr(cls, "_took_run", lose_one)
    integrity = _checked_failure(["--engine", "sglang-0.5.23", *SMALL], tmp_path, plain=False)
    last, steps = runs[0]
    assert integrity["failure_check"] == "lost_page" and integrity["failure_step"] == last
    assert integrity["failure"].startswith(f"steps {last - steps + 1}-{last} (a decode run checked at its end")
