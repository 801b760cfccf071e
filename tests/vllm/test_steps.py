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
    run = SideBySide(trace.requests, settings, 16, case.pool_tokens // 16, case.arrivals,
                     token_base=output_token_base(trace)).run()
    assert run.divergence is None, run.divergence
    assert run.finished == case.limit and run.steps > case.limit
    assert run.real_stats == run.mem_stats and run.mem_stats[1] > 0
    assert run.preemptions >= case.min_preemptions
