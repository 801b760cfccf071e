"""bench-radix: both trees agree on every match; the command prints one JSON document."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.tools.bench_radix.run import run_bench_radix
from memcli.tools.bench_radix.baseline import BaselineRadixCache
from tests.mem_cache.fakes import FakeAllocator

TRACE = Path(__file__).parents[2] / "data" / "conversation_head300.jsonl"


@pytest.mark.parametrize("page_size", [1, 16])
def test_both_trees_match_the_same_lengths_under_eviction(page_size):
    result = run_bench_radix(TRACE, num_requests=120, page_size=page_size, capacity_tokens=60_000, repeat=2)
    assert len(result.radix_runs_s) == len(result.baseline_runs_s) == 2
    assert result.num_requests == 120
    assert result.mismatched_requests == 0
    assert result.matched_tokens == result.baseline_matched_tokens > 0
    assert result.evicted_tokens == result.baseline_evicted_tokens > 0
    assert result.radix_s > 0 and result.baseline_s > 0
    assert result.to_dict()["same_matches"] is True


def test_baseline_tree_basics():
    cache = BaselineRadixCache(FakeAllocator(64, 1), 1)
    assert cache.insert([1, 2, 3, 4], FakeAllocator(64, 1).alloc(4)) == 0
    assert cache.insert([1, 2, 9], FakeAllocator(64, 1).alloc(3)) == 2
    assert len(cache.match_prefix([1, 2, 3, 7])[0]) == 3
    assert cache.evictable_size() == 5


def test_command_prints_one_json_document():
    runner = CliRunner()
    result = runner.invoke(app, ["bench-radix", "--trace", str(TRACE), "--requests", "40", "--capacity", "30000",
                                 "--page-size", "4", "--repeat", "1", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["num_requests"] == 40 and document["page_size"] == 4
    assert document["same_matches"] is True
    assert document["speedup"] > 0


def test_command_rejects_bad_sizes():
    result = CliRunner().invoke(app, ["bench-radix", "--trace", str(TRACE), "--page-size", "0"])
    assert result.exit_code == 2
    assert "error:" in result.stderr and "hint:" in result.stderr
