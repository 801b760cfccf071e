"""The engine seam: tools reach engines only through the registry, so a new engine needs no tool edit.

The toy engine here is a whole engine in a few dozen lines: a memory manager that counts tokens
(no tree, no pages) and a policy that serves one request at a time, first come first served.
`memcli replay` runs on it unchanged.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from memcli import engines
from memcli.cli.app import app
from memcli.errors import ConfigError
from memcli.mem_cache.manager import Usage
from memcli.steps import NO_BATCH, Event, SchedulerHooks, SchedulerStats, StepBatch, StepRecord

TRACE = "tests/data/synthetic_head200.jsonl"


class ToyMemory:
    """A pool of `size` tokens; a request holds prompt + outputs, and gives them back when done."""

    def __init__(self, size: int):
        self.size, self.used, self.max_running = size, 0, 1
        self.stack = SimpleNamespace(memory=self, device=torch.device("cpu"), backend="torch")

    def usage(self) -> Usage:
        return Usage(self.size - self.used, 0, 0)

    def rows_in_use(self) -> int:
        return int(self.used > 0)

    def checker(self, policy):
        return SimpleNamespace(stats=SimpleNamespace(full_walks=0, incremental=0, incremental_s=0.0, walk_s=0.0),
                               after_step=lambda *a, **k: False)

    def check(self, holders):
        assert self.used == sum(len(r.tokens) for r in holders)
        return []

    finish_copies = lambda self: None  # noqa: E731
    take_evictions = take_events = lambda self: []  # noqa: E731
    allocator_totals = lambda self: (0, 0)  # noqa: E731
    host_tier = lambda self: None  # noqa: E731


class ToyScheduler:
    """One request at a time: a prefill step, then a decode step per output token."""

    def __init__(self, memory: ToyMemory, config, hooks: SchedulerHooks):
        self.memory, self.hooks, self.checker = memory, hooks, memory.checker(hooks.checks)
        self.clock_ms, self.step_count = 0.0, 0
        self.waiting, self.finished, self.records, self.stats = [], [], [], SchedulerStats()
        self.events = []
        self.current = None

    def new_req(self, rid, input_ids, max_new_tokens, extra_key=None, arrival_ms=0.0):
        return SimpleNamespace(rid=rid, tokens=list(input_ids), max_new_tokens=max_new_tokens, output_ids=[],
                               input_len=len(input_ids), arrival_ms=arrival_ms, first_cached_tokens=None,
                               admit_ms=None, finish_ms=None, finished=False, aborted=False, retraction_count=0)

    def add_request(self, req) -> None:
        self.waiting.append(req)

    def is_done(self) -> bool:
        return not self.waiting and self.current is None

    def active_reqs(self) -> list:
        return [] if self.current is None else [self.current]

    memory_holders = active_reqs

    def step(self) -> StepRecord:
        kind, new, batch = "idle", 0, NO_BATCH
        if self.current is None and self.waiting and self.waiting[0].arrival_ms <= self.clock_ms:
            req = self.current = self.waiting.pop(0)
            req.first_cached_tokens, req.admit_ms = 0, self.clock_ms
            self.memory.used += len(req.tokens)
            kind, new = "prefill", len(req.tokens)
            batch = StepBatch((req.rid,), (0,), (new,))
            self.stats.prefill_batches += 1
            self.stats.batch_cached_tokens.append(0)
            self.stats.batch_new_tokens.append(new)
        elif self.current is not None:
            req = self.current
            req.output_ids.append(0)
            req.tokens.append(0)
            self.memory.used += 1
            kind, new = "decode", 1
            batch = StepBatch((req.rid,), (0,), (1,))
            self.stats.decode_steps += 1
            if len(req.output_ids) >= req.max_new_tokens:
                self.memory.used -= len(req.tokens)
                req.finish_ms, req.finished, self.current = self.clock_ms, True, None
                self.stats.finished += 1
                self.finished.append(req)
                if self.hooks.record_events:
                    self.events.append(Event(self.step_count, self.clock_ms, "finish", req.rid, len(req.tokens)))
        elif self.waiting:
            self.clock_ms = self.waiting[0].arrival_ms
            self.stats.idle_steps += 1
        self.clock_ms += 1.0
        u = self.memory.usage()
        record = StepRecord(self.step_count, self.clock_ms, kind, int(new > 0), new, len(self.active_reqs()),
                            len(self.waiting), u.available, 0, 0, self.memory.used, 0,
                            batch=batch if self.hooks.record_batches else None)
        self.records.append(record)
        self.step_count += 1
        if self.hooks.on_step is not None:
            self.hooks.on_step(self, record)
        return record


@pytest.fixture
def toy_engine():
    engine = engines.register(engines.Engine(
        name="toy", summary="one request at a time over a token counter",
        build_stack=lambda config, **_: ToyMemory(config.pool_size).stack,
        scheduler=ToyScheduler, profile="sglang-0.5.5"))
    yield engine
    engines.unregister("toy")


def test_replay_runs_on_a_registered_toy_engine(toy_engine):
    result = CliRunner().invoke(app, ["replay", TRACE, "--limit", "5", "--arrivals", "burst", "--json",
                                      "--set", "semantics.engine=toy"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["config"]["semantics"]["engine"] == "toy"
    summary = doc["summary"]
    assert summary["finished"] == 5 and summary["prefill_steps"] == 5
    assert summary["decode_steps"] == summary["output_tokens"] > 0
    assert doc["integrity"]["everything_free_at_end"] and doc["integrity"]["end"]["rows_in_use"] == 0


def test_the_toy_engine_writes_a_step_log(toy_engine, tmp_path):
    path = tmp_path / "steps.jsonl"
    result = CliRunner().invoke(app, ["replay", TRACE, "--limit", "3", "--arrivals", "burst", "--json",
                                      "--set", "semantics.engine=toy", "--steps-out", str(path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    log = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(log) == doc["summary"]["steps"]
    prefills = [s["requests"] for s in log if s["kind"] == "prefill"]
    assert [p[0]["rid"] for p in prefills] == ["1", "2", "3"] and all(len(p) == 1 for p in prefills)
    assert [rid for s in log for rid in s["finished"]] == ["1", "2", "3"]
    pool = doc["allocation"]["pool_tokens"]
    assert all(s["used"] + s["free"] == pool and s["evictable"] == s["protected"] == 0 for s in log)
    assert log[-1]["used"] == 0


def test_an_unknown_engine_is_refused_with_the_names():
    with pytest.raises(ConfigError, match="unknown engine 'nope'") as info:
        engines.get("nope")
    assert "sglang-0.5.5" in info.value.hint
    result = CliRunner().invoke(app, ["replay", TRACE, "--limit", "2", "--set", "semantics.engine=nope"])
    assert result.exit_code == 2 and "sglang-0.5.5" in result.output and "Traceback" not in result.output


def test_a_second_engine_of_the_same_name_is_refused(toy_engine):
    with pytest.raises(ValueError, match="already registered"):
        engines.register(engines.Engine(name="toy", summary="", build_stack=None, scheduler=None, profile=""))


@pytest.mark.parametrize("command", [["show-config"], ["check-page-size"], ["bench-one-batch"],
                                     ["replay", TRACE, "--limit", "2"],
                                     ["reference", "diff", TRACE, "--limit", "2"]])
def test_every_stack_command_takes_engine_and_refuses_an_unknown_one(command):
    result = CliRunner().invoke(app, [*command, "--engine", "nope"])
    assert result.exit_code == 2, result.output
    assert "unknown engine 'nope'" in result.output and "sglang-0.5.5" in result.output


def test_an_engine_brings_its_own_limit_rule(toy_engine):
    """The limits are the engine's (`Engine.limits`), not a branch on its name: a toy rule that
    clips every output past 3 tokens is what the replay reports; without a rule a request past
    the context is refused."""
    import dataclasses

    from memcli.capacity import CutRequest, LimitCuts

    def clip_to_3(config, requests):
        return LimitCuts(tuple(CutRequest(i, s.rid, s.line, "clipped", s.input_len, s.output_len, 3, "toy: at most 3")
                               for i, s in enumerate(requests) if s.output_len > 3), "toy rule")

    engines.register(dataclasses.replace(toy_engine, name="toy-clip", limits=clip_to_3))
    try:
        result = CliRunner().invoke(app, ["replay", TRACE, "--limit", "5", "--arrivals", "burst", "--json",
                                          "--set", "semantics.engine=toy-clip"])
    finally:
        engines.unregister("toy-clip")
    assert result.exit_code == 0, result.output
    limits = json.loads(result.stdout)["limits"]
    assert limits["rule"] == "toy rule" and limits["clipped"] == len(limits["requests"]) > 0
    assert all(r["kept_output_len"] == 3 and r["reason"] == "toy: at most 3" for r in limits["requests"])
    refused = CliRunner().invoke(app, ["replay", TRACE, "--limit", "5", "--arrivals", "burst",
                                       "--set", "semantics.engine=toy", "--set", "memory.max_context_len=64",
                                       "--set", "memory.max_total_tokens=64"])
    assert refused.exit_code == 2 and "error:" in refused.stderr
