"""Eviction records of vLLM's block pool: a block evicted by reuse carries the time from its
caching to its eviction on the pool's clock, and the prefix hits it served while cached."""

import json

from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.mem_cache.block_pool import BlockPool, block_hashes


def test_an_evicted_block_carries_its_age_and_hits():
    now = [5.0]
    pool = BlockPool(3)  # the null block and two more
    pool.clock = lambda: now[0]
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], block_hashes(list(range(4)), 4), 0, 1, 4)
    pool.free_blocks([block])
    now[0] = 9.0
    pool.touch([block])  # a prefix hit takes it out of the free queue
    pool.touch([block])
    pool.free_blocks([block, block])
    now[0] = 12.5
    pool.get_new_blocks(2)  # the uncached block first, then the cached one: evicted
    (removed,) = pool.evicted
    assert (removed.block_id, removed.age, removed.hits) == (block.block_id, 7.5, 2)


def test_replay_eviction_ages_are_simulated_times():
    result = CliRunner().invoke(app, ["replay", "tests/data/conversation_head300.jsonl", "--limit", "60", "--engine",
                                      "vllm-0.33", "--json", "--set", "memory.max_total_tokens=100000",
                                      "--set", "memory.max_context_len=100000"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    eviction = doc["eviction"]
    assert eviction["evictions"] > 0
    assert 0 < eviction["age_ms"]["p50"] <= eviction["age_ms"]["max"] <= doc["summary"]["simulated_time_ms"]
    # A block pool names no uses of what it evicts: no reuse distances, and the document says why.
    assert not eviction["future_known"] and eviction["future_missing"].startswith("vllm-0.33's evictions")


def test_the_text_report_says_why_vllm_reuse_distances_are_not_computed():
    result = CliRunner().invoke(app, ["replay", "tests/data/conversation_head300.jsonl", "--limit", "60", "--engine",
                                      "vllm-0.33", "--set", "memory.max_total_tokens=100000",
                                      "--set", "memory.max_context_len=100000"])
    assert result.exit_code == 0, result.output
    assert "do not name the requests that use" in " ".join(result.output.split())
