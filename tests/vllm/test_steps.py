"""memcli's vLLM scheduler against vLLM 0.33's real v1 `Scheduler` under a fake model, step
by step on the bundled traces: equal tokens scheduled per request, preemptions, finishes,
block ids and prefix-cache stats."""

from typing import NamedTuple

import pytest

from memcli.workload.readers import read_trace
from memcli.workload.spec import output_token_base


class Case(NamedTuple):
    trace: str
    limit: int
    pool_tokens: int
    budget: int
    arrivals: str
    threshold: int = 0
    min_preemptions: int = 0
    loop: str = "async"


CASES = [
    Case("tests/data/conversation_head300.jsonl", 40, 200_000, 2048, "burst", loop="sync"),
    Case("tests/data/conversation_head300.jsonl", 40, 200_000, 2048, "burst"),
    Case("tests/data/conversation_head300.jsonl", 80, 200_000, 2048, "timestamp"),
    Case("tests/data/synthetic_head200.jsonl", 60, 90_000, 512, "burst", 256, min_preemptions=1, loop="sync"),
    Case("tests/data/synthetic_head200.jsonl", 60, 90_000, 512, "burst", 256, min_preemptions=1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.trace.split('/')[-1]}-{c.limit}-{c.arrivals}-{c.pool_tokens}-{c.loop}")
def test_no_step_diverges(vllm_ref, case):
    from memcli.reference.vllm033.steps import SideBySide
    from memcli.vllm_sched.scheduler import VllmSchedulerConfig

    trace = read_trace(case.trace, limit=case.limit)
    settings = VllmSchedulerConfig(case.budget, 128, 131072, long_prefill_token_threshold=case.threshold,
                                   async_scheduling=case.loop == "async")
    # a logged window of 8 requests, so that it drops steps on these short runs
    run = SideBySide(trace.requests, settings, 16, case.pool_tokens // 16, case.arrivals,
                     token_base=output_token_base(trace), window_requests=8).run()
    assert run.divergence is None, run.divergence
    assert run.finished == case.limit and run.steps > case.limit
    assert run.real_stats == run.mem_stats and run.mem_stats[1] > 0
    assert run.real_window == run.mem_window and 0 < run.mem_window[0] <= 8 + 8
    assert run.preemptions >= case.min_preemptions


def _with_priorities(specs: list) -> list:
    """Priorities that reorder the queue against arrival: later requests mostly come first,
    with ties (three levels) left to arrival time and request id."""
    import dataclasses
    return [dataclasses.replace(s, priority=-((i * 7) % 3) - i // 20) for i, s in enumerate(specs)]


# The synthetic cases preempt (victims other than the latest admitted, victims scheduled earlier
# in the step, and requests that preempt themselves while later running ones go on).
PRIORITY_CASES = [
    Case("tests/data/synthetic_head200.jsonl", 60, 60_000, 512, "burst", 256, min_preemptions=5, loop="sync"),
    Case("tests/data/synthetic_head200.jsonl", 60, 60_000, 512, "burst", 256, min_preemptions=5),
    Case("tests/data/conversation_head300.jsonl", 80, 200_000, 2048, "timestamp"),
]


def _priority_run(case: Case, memcli_policy: str = "priority"):
    from memcli.config import SimConfig
    from memcli.mem_cache.block_manager import BlockManager
    from memcli.reference.vllm033.steps import SideBySide
    from memcli.steps import SchedulerHooks
    from memcli.vllm_sched.scheduler import VllmScheduler, VllmSchedulerConfig

    trace = read_trace(case.trace, limit=case.limit)
    make = lambda policy: VllmSchedulerConfig(case.budget, 128, 131072, long_prefill_token_threshold=case.threshold,
                                              policy=policy, async_scheduling=case.loop == "async")
    sbs = SideBySide(_with_priorities(trace.requests), make("priority"), 16, case.pool_tokens // 16, case.arrivals,
                     token_base=output_token_base(trace))
    if memcli_policy != "priority":  # memcli's side as if it ignored the priorities
        memory = BlockManager(sbs.num_blocks, 16, 131072, max_running=128)
        sbs.mem = VllmScheduler(memory, make(memcli_policy), SimConfig(), SchedulerHooks(output_token_base=sbs.token_base))
        sbs.mem.keep_plans = True
    return sbs.run()


@pytest.mark.parametrize("case", PRIORITY_CASES, ids=lambda c: f"{c.trace.split('/')[-1]}-{c.limit}-{c.arrivals}-{c.loop}")
def test_priority_policy_no_step_diverges(vllm_ref, case):
    run = _priority_run(case)
    assert run.divergence is None, run.divergence
    assert run.finished == case.limit and run.real_stats == run.mem_stats
    assert run.preemptions >= case.min_preemptions


@pytest.mark.parametrize("case", PRIORITY_CASES[:1], ids=lambda c: f"{c.trace.split('/')[-1]}-{c.loop}")
def test_priority_policy_ignored_diverges(vllm_ref, case):
    """The same run with memcli scheduling FCFS: vLLM's priority order shows within a few steps."""
    run = _priority_run(case, memcli_policy="fcfs")
    assert run.divergence is not None
