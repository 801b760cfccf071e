"""The extend floor: the prefill's own kernel replayed bare, beside the prefill memory path."""

from __future__ import annotations

import pytest
import torch

from memcli.config import load_config, replace
from memcli.stack import build_stack
from memcli.tools.bench_one_batch.cases import Case
from memcli.tools.bench_one_batch.phases import PhaseTiming, combine_rounds
from memcli.tools.bench_one_batch.results import combine_case_rounds, paired_ratio
from memcli.tools.bench_one_batch.rounds import BenchOptions, run_case
from memcli.tools.bench_one_batch.runner import CaseRunner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the extend floor is a CUDA graph")


def _timing(*medians: float) -> PhaseTiming:
    return combine_rounds([PhaseTiming(m, m, 3, "cuda-events", 1.0, 0) for m in medians])


def test_a_cpu_stack_has_no_extend_floor():
    stack = build_stack(load_config(None, ["runtime.device=cpu"]))
    runner = CaseRunner(stack, Case(2, 24, 2, 0, 1))
    runner.start()
    assert runner.batch.prepare_for_extend()
    assert stack.memory.bare_extend(runner.batch.extend_plan, [r.kv.req_pool_idx for r in runner.reqs]) is None
    case = run_case(build_stack(load_config(None, ["runtime.device=cpu"])), Case(2, 24, 2, 0, 1),
                    BenchOptions(repeat=1, warmup=0))
    assert "extend_floor" not in case.phases and case.prefill_over_floor() is None


def test_the_prefill_over_its_floors_is_paired_round_by_round():
    """Per round: the prefill path over the launch floor and over the extend floor, and the
    extend floor over the launch floor, each the median of the rounds' ratios."""
    cfg = load_config(None, ["runtime.device=cpu"])
    one = run_case(build_stack(cfg), Case(2, 24, 2, 0, 1), BenchOptions(repeat=1, warmup=0))
    import dataclasses
    phases = dict(one.phases, prefill_memory=_timing(30.0, 60.0, 33.0), launch_floor=_timing(10.0, 20.0, 10.0),
                  extend_floor=_timing(20.0, 40.0, 30.0))
    case = dataclasses.replace(one, phases=phases)
    over = case.prefill_over_floor()
    assert over["launch"] == pytest.approx(3.0)  # ratios 3.0, 3.0, 3.3
    assert over["extend"] == pytest.approx(1.5)  # 1.5, 1.5, 1.1
    assert over["extend_floor_over_launch"] == pytest.approx(2.0)  # 2.0, 2.0, 3.0
    assert over["extend"] == paired_ratio(phases["prefill_memory"], phases["extend_floor"])
    assert case.to_dict()["prefill_over_floor"] == over
    without = dataclasses.replace(one, phases=dict(phases, extend_floor=None))
    without.phases.pop("extend_floor")
    assert without.prefill_over_floor() == {"launch": pytest.approx(3.0), "extend": None,
                                            "extend_floor_over_launch": None}


@needs_cuda
@pytest.mark.parametrize("page_size, prefix_len", [(1, 0), (1, 40), (16, 40), (64, 0)])
def test_the_extend_floor_writes_what_the_extend_writes(page_size, prefix_len):
    """The floor's replay gives the slots, rows and lengths of the batch's extend and writes
    the same `req_to_token` rows, from the same free-list head, leaving the allocator's state
    as it was."""
    cfg = replace(load_config(None, ["memory.kv_pool=indices"]), memory={"page_size": page_size})
    stack = build_stack(cfg)
    runner = CaseRunner(stack, Case(3, 96, 2, prefix_len, page_size))
    runner.start()
    assert runner.batch.prepare_for_extend()
    rows = [r.kv.req_pool_idx for r in runner.reqs]
    want = [t.clone() for t in (runner.batch.out_cache_loc, runner.batch.req_pool_indices, runner.batch.seq_lens)]
    table = stack.req_to_token_pool.req_to_token[rows].clone()
    runner.restore_prefill()
    head = stack.allocator.free_head
    stack.req_to_token_pool.req_to_token[rows] = 0
    floor = stack.memory.bare_extend(runner.batch.extend_plan, rows)
    assert floor is not None
    for _ in range(3):
        got = floor.replay()
    torch.cuda.synchronize()
    assert got.out_cache_loc.tolist() == want[0].tolist()
    assert got.req_pool_indices.tolist() == want[1].tolist() and got.seq_lens.tolist() == want[2].tolist()
    assert torch.equal(stack.req_to_token_pool.req_to_token[rows], table)
    assert stack.allocator.free_head == head


@needs_cuda
def test_a_gpu_case_times_the_extend_floor_beside_the_prefill():
    cfg = load_config(None, ["memory.kv_pool=indices"])
    rounds = [run_case(build_stack(cfg), Case(4, 64, 3, 0, 1), BenchOptions(repeat=5, warmup=1), None)
              for _ in range(2)]
    case = combine_case_rounds(rounds)
    floor = case.phases["extend_floor"]
    assert floor.samples == case.phases["prefill_memory"].samples and floor.median_us > 0
    assert floor.syncs == 0
