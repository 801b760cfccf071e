"""vLLM's own prefix-cache counters as memcli reports them (`memcli.steps.VllmReported`):
the logged window against vLLM's real `CachingMetrics`, and the replay's document."""

import json
import random

from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.steps import VllmReported


def _random_steps(rng: random.Random, n: int) -> list[tuple]:
    steps = []
    for _ in range(n):
        fresh = rng.choice((0, 1, 1, 2, 5, 17))
        again = rng.choice((0, 0, 1))
        if fresh == again == 0:
            fresh = 1
        queries = sum(rng.randint(1, 4000) for _ in range(fresh))
        pre_q = sum(rng.randint(1, 4000) for _ in range(again))
        steps.append((fresh, queries, rng.randint(0, queries), again, pre_q, rng.randint(0, pre_q)))
    return steps


def test_window_is_vllms_caching_metrics(vllm_ref):
    rng = random.Random(5)
    for max_recent in (1, 7, 40, 1000):
        steps = _random_steps(rng, 300)
        real = vllm_ref.stats.CachingMetrics(max_recent_requests=max_recent)
        for st in steps:
            real.observe(vllm_ref.stats.PrefixCacheStats(
                requests=st[0], queries=st[1], hits=st[2],
                preempted_requests=st[3], preempted_queries=st[4], preempted_hits=st[5]))
        mine = VllmReported.of_steps(steps, max_recent)
        assert (mine.window_requests, mine.window_queries, mine.window_hits) == (
            real.aggregated_requests, real.aggregated_query_total, real.aggregated_query_hit)
        assert mine.requests == sum(s[0] for s in steps) and mine.preempted_hits == sum(s[5] for s in steps)


def test_replay_reports_vllms_counters_with_preemptions_apart():
    args = ["replay", "tests/data/conversation_head300.jsonl", "--engine", "vllm-0.33", "--json",
            "--set", "memory.max_total_tokens=140000", "--set", "memory.max_context_len=130000"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    prefix = json.loads(out.stdout)["prefix_cache"]
    reported, every = prefix["vllm_reported"], prefix["vllm"]
    assert reported["preempted"]["requests"] > 0  # this pool preempts
    # every admission is one of vLLM's two counters: fresh ones and re-admissions
    assert reported["per_run"]["queries"] + reported["preempted"]["queries"] == every["queries"]
    assert reported["per_run"]["hits"] + reported["preempted"]["hits"] == every["hits"]
    assert reported["per_run"]["requests"] == prefix["requests"]
    # a run of 300 requests fits the 1,000-request window whole
    assert reported["logged_window"]["queries"] == reported["per_run"]["queries"]


def test_sglang_documents_have_no_vllm_counters():
    out = CliRunner().invoke(app, ["replay", "tests/data/synthetic_head200.jsonl", "--limit", "20",
                                   "--engine", "sglang-0.5.5", "--json"])
    assert out.exit_code == 0, out.output
    assert "vllm_reported" not in json.loads(out.stdout)["prefix_cache"]
