"""Step-level differential against SGLang 0.5.23: both its loops over its own Req,
ScheduleBatch, PrefillAdder, allocation.py, common.py and UnifiedRadixCache (Rust tree core),
vs memcli's scheduler under the sglang-0.5.23 engine, on the bundled traces (the cases of the
0.5.5 step tests): every step's batch, prefixes, slots, evictions, retractions, finishes and
pool sizes are equal, and 0.5.23's own loop finishes every request and conserves the pool."""

import dataclasses

import pytest

from memcli.config import replace
from memcli.reference.v0523.diff import compare_steps, reference_steps
from tests.reference.test_steps import CASES, _load, break_runs

ENGINE = {"engine": "sglang-0.5.23", "profile": "sglang-0.5.23", "event_loop": "normal"}


def _case(case, event_loop="normal"):
    config, requests, base = _load(case, event_loop)
    return replace(config, semantics={**ENGINE, "event_loop": event_loop}), requests, base


@pytest.mark.parametrize("event_loop", ["overlap", "normal"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_steps_match_sglang_0523(worker0523, case, event_loop):
    config, requests, base = _case(case, event_loop)
    steps = reference_steps(worker0523, config, requests, case.arrivals, base)
    finished = [rid for step, _ in steps for rid in step.finished]
    assert sorted(finished, key=int) == sorted((r.rid for r in requests), key=int)
    last = steps[-1].obs
    assert last.available + last.evictable == config.pool_size and last.protected == 0
    diff = compare_steps(steps, config, requests, case.arrivals, base)
    assert diff.failure is None, diff.failure
    assert diff.divergence is None, "\n".join(["sglang:", *diff.divergence[0].lines(), "memcli:", *diff.divergence[1].lines()])
    assert diff.steps == len(steps)


def test_the_0523_engine_is_not_0055(worker0523):
    """The same case under the 0.5.5 engine's behaviours diverges from 0.5.23's loop."""
    case = CASES[1]
    config, requests, base = _case(case)
    steps = reference_steps(worker0523, config, requests, case.arrivals, base)
    old = replace(config, semantics={"engine": "sglang-0.5.5", "profile": "sglang-0.5.5", "event_loop": "normal",
                                     "row_order": "lifo_row0"})  # past the rows, which differ at step 0
    diff = compare_steps(steps, old, requests, case.arrivals, base)
    assert diff.divergence is not None and diff.steps < len(steps)


def test_request_rows_are_0523s(worker0523):
    """Rows come from the tail with row 0 reserved: memcli's FIFO rows are caught."""
    case = CASES[3]
    config, requests, base = _case(case)
    steps = reference_steps(worker0523, config, requests, case.arrivals, base)
    assert compare_steps(steps, config, requests, case.arrivals, base).failure is None
    fifo = replace(config, semantics={**ENGINE, "row_order": "fifo"})
    assert "request rows" in compare_steps(steps, fifo, requests, case.arrivals, base).failure


def test_overlap_skips_the_decode_of_requests_finishing_in_flight(worker0523):
    """0.5.5's overlap loop (one more decode of a request its in-flight result finishes) is caught."""
    case = CASES[1]
    config, requests, base = _case(case, "overlap")
    steps = reference_steps(worker0523, config, requests, case.arrivals, base)
    old = replace(config, semantics={**ENGINE, "event_loop": "overlap", "skip_finishing_decode": "decode",
                                     "overlap_release": "lagging"})
    assert compare_steps(steps, old, requests, case.arrivals, base).divergence is not None


@pytest.mark.parametrize("event_loop", ["overlap", "normal"])
def test_ignore_eos_requests_are_reserved_whole(worker0523, event_loop):
    """Every other request `ignore_eos`: 0.5.23 reserves their remaining output whole in
    admission, which changes its steps; memcli follows it step by step, and the 0.5.5 reserve
    (times the new-token ratio, `ignore_eos_ratio: ratio`) is caught."""
    case = CASES[1]
    config, plain, base = _case(case, event_loop)
    requests = [dataclasses.replace(r, ignore_eos=i % 2 == 0) for i, r in enumerate(plain)]
    steps = reference_steps(worker0523, config, requests, case.arrivals, base)
    assert [s.obs for s in steps] != [s.obs for s in reference_steps(worker0523, config, plain, case.arrivals, base)]
    diff = compare_steps(steps, config, requests, case.arrivals, base)
    assert diff.failure is None and diff.divergence is None and diff.steps == len(steps)
    ratio = replace(config, semantics={**ENGINE, "event_loop": event_loop, "ignore_eos_ratio": "ratio"})
    assert compare_steps(steps, ratio, requests, case.arrivals, base).divergence is not None


def _eos(requests):
    """Every other request ends on EOS: max_new_tokens 40 over the tokens it generates."""
    return [dataclasses.replace(r, max_new_tokens=r.output_len + 40) if i % 2 == 0 else r
            for i, r in enumerate(requests)]


@pytest.mark.parametrize("event_loop", ["overlap", "normal"])
def test_requests_finishing_on_eos(worker0523, event_loop):
    """Requests that stop on EOS before max_new_tokens (retractions included, page size 16):
    memcli follows 0.5.23 step by step."""
    case = CASES[5]
    config, plain, base = _case(case, event_loop)
    requests = _eos(plain)
    steps = reference_steps(worker0523, config, requests, case.arrivals, base)
    assert sorted(rid for step, _ in steps for rid in step.finished) == sorted(r.rid for r in requests)
    diff = compare_steps(steps, config, requests, case.arrivals, base)
    assert diff.failure is None and diff.divergence is None and diff.steps == len(steps)


def test_an_eos_finish_under_overlap_inserts_the_token_in_flight(worker0523):
    """Under overlap an EOS finish was decoded once more; 0.5.23 inserts that token too (page
    size 1, so every token counts): leaving it out (`eos_extra_insert: none`) is caught."""
    case = CASES[1]
    config, plain, base = _case(case, "overlap")
    requests = _eos(plain)
    steps = reference_steps(worker0523, config, requests, case.arrivals, base)
    diff = compare_steps(steps, config, requests, case.arrivals, base)
    assert diff.failure is None and diff.divergence is None and diff.steps == len(steps)
    none = replace(config, semantics={**ENGINE, "event_loop": "overlap", "eos_extra_insert": "none"})
    sglang, memcli = compare_steps(steps, none, requests, case.arrivals, base).divergence
    assert sglang.evictable == memcli.evictable + 1  # the first EOS finish: one token fewer in the tree


def test_a_prefill_results_frees_are_one_group(worker0523):
    """0.5.23 frees what a prefill result gives back in one group: under the overlap loop at
    page size 16 two requests' duplicate prefix pages (both matching a chunk that entered the
    tree first) go back together, so the next prefill takes the first request's pages first.
    Freeing them one by one (0.5.5) hands out other pages at step 2."""
    from pathlib import Path

    from memcli.config import load_config
    from memcli.workload.readers import read_trace
    from memcli.workload.spec import output_token_base

    repo = Path(__file__).resolve().parents[2]
    config = load_config(str(repo / "configs" / "replay.yaml"), [
        "semantics.engine=sglang-0.5.23", "semantics.event_loop=overlap", "memory.page_size=16",
        "memory.max_total_tokens=200000"])
    trace = read_trace(str(repo / "tests" / "data" / "conversation_head300.jsonl"), limit=8)
    base = output_token_base(trace)
    steps = reference_steps(worker0523, config, trace.requests, "burst", base, 12)
    diff = compare_steps(steps, config, trace.requests, "burst", base)
    # the reference was cut at 12 steps: memcli agrees on all of them and has steps left
    assert len(steps) == 12 and diff.steps == 13 and diff.failure.startswith("memcli's scheduler has steps left")
    one_by_one = replace(config, semantics={"prefill_free_group": "none"})
    diff = compare_steps(steps, one_by_one, trace.requests, "burst", base)
    assert diff.failure is None and diff.divergence is not None and diff.divergence[0].step == 2
    assert diff.divergence[0].differing(diff.divergence[1]) == ["out_cache_loc"]


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=[CASES[1].name, CASES[3].name])
def test_decode_runs_are_compared_step_by_step_0523(worker0523, case, monkeypatch):
    # memcli's steady decode runs, taken at once, are compared with 0.5.23's steps one by one:
    # the same result as the plain loop, every step seen, a slot written wrong inside a run found.
    from memcli.sched import decode_run

    config, requests, base = _case(case, "overlap")
    steps = reference_steps(worker0523, config, requests, case.arrivals, base)
    taken, compared = [], []
    take = decode_run.DecodeRuns.take
    monkeypatch.setattr(decode_run.DecodeRuns, "take", lambda self, *a: taken.append(take(self, *a)) or taken[-1])
    fast = compare_steps(steps, config, requests, case.arrivals, base,
                         on_step=lambda sglang, memcli: compared.append(memcli.step))
    assert fast.failure is None and fast.divergence is None and fast.steps == len(steps)
    assert max(taken) >= 3 and sum(taken) > 0.1 * len(steps) and compared == list(range(len(steps)))
    plain = compare_steps(steps, config, requests, case.arrivals, base, plain_loop=True)
    assert plain.failure is None and plain.divergence is None

    break_runs(monkeypatch, case)
    broken = compare_steps(steps, config, requests, case.arrivals, base)
    sglang, memcli = broken.divergence
    assert memcli.kind == "decode" and memcli.differing(sglang) == ["out_cache_loc"]
