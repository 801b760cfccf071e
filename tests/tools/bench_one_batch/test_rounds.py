"""Statistics of bench-one-batch: rounds over interleaved cases, the median of round medians,
the spread and the flag on unstable figures; and `--compare sglang-0.5.5`."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.config import load_config, replace
from memcli.errors import IntegrityError
from memcli.reference.fetch import unavailable_reason
from memcli.stack import build_stack
from memcli.tools.bench_one_batch.cases import Case
from memcli.tools.bench_one_batch.phases import UNSTABLE_SPREAD, PhaseTiming, combine_rounds
from memcli.tools.bench_one_batch.results import combine_case_rounds
from memcli.tools.bench_one_batch.rounds import BenchOptions, run_case, run_cases
from memcli.tools.bench_one_batch.runner import CaseRunner

runner = CliRunner()


def timing(median: float, low: float, first_ms: float = 1.0, syncs=None) -> PhaseTiming:
    return PhaseTiming(median, low, 5, "wall-clock (cpu)", first_ms, syncs)


def test_rounds_combine_to_the_median_of_round_medians():
    rounds = [timing(10.0, 9.0, first_ms=7.0), timing(30.0, 8.0, first_ms=0.1), timing(12.0, 11.0)]
    t = combine_rounds(rounds)
    assert t.median_us == 12.0  # the median of 10, 30, 12: one noisy round moves nothing
    assert t.min_us == 8.0 and t.samples == 15
    assert t.first_call_ms == 7.0  # the first round's first call is the one that compiled
    assert t.round_medians == (10.0, 30.0, 12.0)
    assert t.spread == pytest.approx(3.0) and t.unstable
    steady = combine_rounds([timing(10.0, 9.0), timing(11.0, 9.5)])
    assert steady.spread == pytest.approx(1.1) and not steady.unstable
    edge = combine_rounds([timing(10.0, 9.0), timing(10.0 * UNSTABLE_SPREAD, 9.0)])
    assert not edge.unstable  # the limit itself is still stable
    assert combine_rounds([timing(5.0, 4.0)]).spread == 1.0


def test_the_paired_speedup_divides_a_slow_spell_out_round_by_round():
    """Round 2 ran in a slow spell that doubled both sides: the ratio of the medians moves,
    the median of the per-round ratios does not."""
    from memcli.tools.bench_one_batch.results import paired_speedup, speedup

    mine = combine_rounds([timing(10.0, 9.0), timing(20.0, 9.0), timing(20.0, 9.0)])
    ref = combine_rounds([timing(40.0, 9.0), timing(80.0, 9.0), timing(44.0, 9.0)])
    assert speedup(mine, ref) == pytest.approx(44.0 / 20.0)
    assert paired_speedup(mine, ref) == pytest.approx(4.0)  # the ratios 4, 4, 2.2
    assert paired_speedup(mine, combine_rounds([timing(40.0, 9.0)])) is None  # rounds that do not pair


def _small_config(page_size: int = 1):
    cfg = load_config(None, ["runtime.device=cpu"])
    return replace(cfg, memory={"page_size": page_size})


def test_cases_are_interleaved_round_by_round():
    cases = [Case(1, 24, 2, 0, 1), Case(2, 24, 2, 0, 1), Case(1, 24, 2, 0, 4)]
    seen = []
    result = run_cases(_small_config(), cases, BenchOptions(repeat=2, warmup=0, rounds=3),
                                 progress=lambda r, rounds, n, count, case: seen.append((r, case)))
    assert seen == [(r, c) for r in (1, 2, 3) for c in cases]
    for case in result.cases:
        for name, phase in case.phases.items():
            assert phase.rounds == 3 and len(phase.round_medians) == 3, name
            assert phase.samples >= 3 * 2, name
            assert phase.median_us == sorted(phase.round_medians)[1]


def test_a_round_that_allocates_differently_is_an_error():
    cfg = _small_config()
    stack = build_stack(cfg)
    case = Case(2, 24, 2, 0, 1)
    one = run_case(stack, case, BenchOptions(repeat=1, warmup=0))
    two = run_case(stack, case, BenchOptions(repeat=1, warmup=0))
    assert combine_case_rounds([one, two]).prefill_allocated_tokens == one.prefill_allocated_tokens
    import dataclasses
    bad = dataclasses.replace(two, decode_allocated_tokens=two.decode_allocated_tokens + 1)
    with pytest.raises(IntegrityError, match="decode_allocated_tokens differs between rounds"):
        combine_case_rounds([one, bad])


class _CountingFloor:
    """Stands in for `GraphFloor` on a CPU: the bench only calls `replay`."""

    def __init__(self):
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_the_launch_floor_is_timed_beside_every_decode_step():
    """With a floor, each decode step's memory path has the floor timed just before it: the
    case carries `launch_floor` with as many samples as the memory path, and the decode path
    over the floor, per round and as a ratio of medians."""
    from memcli.tools.bench_one_batch.results import paired_ratio

    cfg = _small_config()
    floor = _CountingFloor()
    case = Case(2, 24, 3, 0, 1)
    options = BenchOptions(repeat=3, warmup=1)
    rounds = [run_case(build_stack(cfg), case, options, floor) for _ in range(3)]
    one = rounds[0]
    steps = len(one.decode_step_us)
    assert steps == 2  # the sglang-0.5.5 profile: output_len - 1 steps
    assert one.phases["launch_floor"].samples == one.phases["decode_memory"].samples == steps * 3  # 3 calls a step
    assert floor.replays >= 3 * steps * (1 + 3)  # three rounds of each step's warm-up and timed calls
    combined = combine_case_rounds(rounds)
    over = combined.decode_over_floor()
    memory, launch = combined.phases["decode_memory"], combined.phases["launch_floor"]
    assert over["ratio"] == pytest.approx(memory.median_us / launch.median_us)
    assert over["per_round"] == pytest.approx(paired_ratio(memory, launch))
    assert combined.to_dict()["decode_over_floor"] == over
    assert run_case(build_stack(cfg), case, options).decode_over_floor() is None  # no floor: no ratio


def test_the_paired_ratio_is_the_median_of_the_rounds_ratios():
    from memcli.tools.bench_one_batch.results import paired_ratio

    path = combine_rounds([timing(15.0, 9.0), timing(30.0, 9.0), timing(16.0, 9.0)])
    floor = combine_rounds([timing(12.0, 9.0), timing(24.0, 9.0), timing(12.0, 9.0)])
    assert paired_ratio(path, floor) == pytest.approx(1.25)  # ratios 1.25, 1.25, 1.33
    assert paired_ratio(path, combine_rounds([timing(12.0, 9.0)])) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the launch floor is a CUDA graph")
def test_a_gpu_run_times_the_floor_per_case_and_reports_it():
    cfg = load_config(None, ["memory.kv_pool=indices"])
    cases = [Case(4, 64, 3, 0, 1), Case(4, 64, 3, 0, 16)]
    result = run_cases(cfg, cases, BenchOptions(repeat=5, warmup=1, rounds=3))
    for case in result.cases:
        over = case.decode_over_floor()
        assert over is not None and over["ratio"] > 0 and over["per_round"] > 0
        assert case.phases["launch_floor"].rounds == 3
    assert result.floor is not None and result.floor.rounds == 3


def test_json_carries_rounds_spread_and_the_unstable_flag():
    result = runner.invoke(app, ["bench-one-batch", "--set", "runtime.device=cpu", "-b", "2", "--input-len", "32",
                                 "--output-len", "2", "--repeat", "2", "--warmup", "0", "--rounds", "3", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["options"]["rounds"] == 3
    phase = doc["cases"][0]["phases"]["decode_memory"]
    assert phase["rounds"] == 3 and len(phase["round_medians_us"]) == 3
    assert phase["spread"] == pytest.approx(max(phase["round_medians_us"]) / min(phase["round_medians_us"]))
    assert phase["unstable"] == (phase["spread"] > UNSTABLE_SPREAD)
    assert doc["compare"] is None


def test_rounds_must_be_positive():
    result = runner.invoke(app, ["bench-one-batch", "--rounds", "0"])
    assert result.exit_code == 2 and "--rounds" in result.stderr


def test_compare_without_the_wheel_names_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMCLI_CACHE_DIR", str(tmp_path))
    result = runner.invoke(app, ["bench-one-batch", "--compare", "sglang-0.5.5"])
    assert result.exit_code == 2
    assert "memcli reference fetch" in result.stderr and "Traceback" not in result.stderr


def test_compare_rejects_an_unknown_implementation():
    result = runner.invoke(app, ["bench-one-batch", "--compare", "vllm"])
    assert result.exit_code == 2 and "sglang-0.5.5" in result.stderr


def test_compare_backend_needs_compare_and_a_known_name():
    alone = runner.invoke(app, ["bench-one-batch", "--compare-backend", "fa3"])
    assert alone.exit_code == 2 and "needs --compare" in alone.stderr and "Traceback" not in alone.stderr


needs_reference = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@needs_reference
@pytest.mark.parametrize("tree_cache, page_size, prefix", [("none", 1, 0), ("radix", 4, 8), ("chunk", 4, 8)])
def test_sglang_side_runs_the_same_batch_slot_for_slot(tree_cache, page_size, prefix):
    """The compared case is the same work: after the prefill and the decode steps, SGLang's
    request rows hold exactly the slots memcli's hold (sglang-0.5.5 profile)."""
    from memcli.reference.loader import load_reference
    from memcli.tools.bench_one_batch.sglang_side import SglangCase

    ref = load_reference()
    cfg = replace(_small_config(page_size), cache={"kind": tree_cache}, semantics={"engine": "sglang-0.5.5"})
    case = Case(3, 20, 4, prefix, page_size)
    mine = CaseRunner(build_stack(cfg), case)
    mine.start()
    mine.batch.prepare_for_extend()
    for _ in range(mine.decode_steps):
        mine.batch.prepare_for_decode()
    theirs = SglangCase(ref, case, cfg)
    theirs.replay_to_finish()
    assert theirs.decode_steps == mine.decode_steps == 3
    seq = case.input_len + mine.decode_steps
    for a, b in zip(mine.reqs, theirs.batch.reqs):
        assert a.req_pool_idx == b.req_pool_idx
        ours = mine.stack.req_to_token_pool.req_to_token[a.req_pool_idx, :seq].to(torch.int64)
        sglang = theirs.pool.req_to_token[b.req_pool_idx, :seq].to(torch.int64).cpu()
        assert torch.equal(ours, sglang)
    theirs.finish()  # SGLang's own finish leaves its stack idle
    assert theirs.allocator.available_size() + theirs.tree_cache.evictable_size() == theirs.allocator.size
    assert len(theirs.pool.free_slots) == theirs.pool.size


@needs_reference
def test_sglangs_decode_is_timed_beside_the_floor_as_memclis_is():
    """With a floor, SGLang's decode memory path is timed in turn with it, as memcli's is."""
    from memcli.reference.loader import load_reference
    from memcli.tools.bench_one_batch.sglang_side import SglangComparison

    ref = load_reference()
    cfg = replace(_small_config(1), runtime={"device": ref.device})
    floor = _CountingFloor()
    side = SglangComparison(ref, torch.device(ref.device))
    phases = side.run_case(Case(2, 24, 3, 0, 1), cfg, BenchOptions(repeat=3, warmup=1), floor)
    assert phases["launch_floor"].samples == phases["decode_memory"].samples == 2 * 3  # 2 steps, 3 calls each
    assert floor.replays >= 2 * (1 + 3)
    assert "launch_floor" not in side.run_case(Case(2, 24, 3, 0, 1), cfg, BenchOptions(repeat=1))


@needs_reference
def test_compare_prints_a_speedup_per_phase():
    from memcli.reference.loader import load_reference

    result = runner.invoke(app, ["bench-one-batch", "--set", f"runtime.device={load_reference().device}", "-b", "2",
                                 "--input-len", "24",
                                 "--output-len", "3", "--page-size", "1", "--repeat", "1", "--warmup", "0",
                                 "--rounds", "2", "--compare", "sglang-0.5.5", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    rows = doc["compare"]["rows"]
    assert doc["compare"]["name"] == "sglang-0.5.5"
    from memcli.reference.backends import default_backend
    backend = default_backend(torch.device(load_reference().device).type)
    assert doc["compare"]["attention_backend"] == backend and doc["compare"]["backend"].startswith(backend)
    assert [r["phase"] for r in rows] == ["prefill_memory", "decode_memory", "free"]
    for row in rows:
        assert row["reference"]["rounds"] == 2 and row["memcli"]["rounds"] == 2
        assert row["speedup"] == pytest.approx(row["reference"]["median_us"] / row["memcli"]["median_us"])
        pairs = [r / m for m, r in zip(row["memcli"]["round_medians_us"], row["reference"]["round_medians_us"])]
        assert row["paired_speedup"] == pytest.approx(sum(pairs) / 2)  # the median of two ratios


@needs_reference
def test_compare_backend_is_checked_before_anything_runs():
    unknown = runner.invoke(app, ["bench-one-batch", "--compare", "sglang-0.5.5", "--compare-backend", "fa9"])
    assert unknown.exit_code == 2 and "not an attention backend" in unknown.stderr
    if not torch.cuda.is_available():
        triton_path = runner.invoke(app, ["bench-one-batch", "--compare", "sglang-0.5.5", "--compare-backend", "fa3"])
        assert triton_path.exit_code == 2 and "needs CUDA" in triton_path.stderr


def test_slow_start_notes_name_sglangs_large_extend_block():
    """A paged case whose batch extends by 393,216 tokens makes SGLang compile a 524,288-token
    block: the user is told before minutes of silence; small or page-1 cases say nothing."""
    from memcli.tools.bench_one_batch.sglang_side import slow_start_notes

    big = Case(batch_size=256, input_len=1536, output_len=4, prefix_len=0, page_size=16)
    small = Case(batch_size=32, input_len=1536, output_len=4, prefix_len=1024, page_size=16)
    page1 = Case(batch_size=256, input_len=1536, output_len=4, prefix_len=0, page_size=1)
    notes = slow_start_notes([small, big], "cuda")
    assert len(notes) == 1 and "524,288" in notes[0]
    assert slow_start_notes([small, page1], "cuda") == []  # 16,384-token block: compiles in seconds
    assert slow_start_notes([page1], "cpu") == []
    assert "interpreter" in slow_start_notes([small], "cpu")[0]
