"""Sweep parsing, the overrides per value, and the unlimited-pool reference (replayed or computed)."""

from __future__ import annotations

import pytest

from memcli.config import apply_overrides, config_from_dict
from memcli.errors import CapacityError, ConfigError, MemcliError
from memcli.tools.replay import sweep as sweep_mod
from memcli.tools.replay.ceiling import shared_prefix_lens
from memcli.tools.replay.runner import ReplayOptions
from memcli.tools.replay.sweep import parse_sweep, run_sweep, unlimited_pool_tokens
from memcli.workload.readers import read_trace

from tests.tools.replay.helpers import CONVERSATION, shrink_mooncake, small_config


def test_parse_sweep_reads_values_as_yaml():
    spec = parse_sweep("memory.max_total_tokens=1000, 2000")
    assert spec.key == "memory.max_total_tokens" and spec.values == (1000, 2000)
    assert parse_sweep("cache.eviction_policy=lru,lfu").values == ("lru", "lfu")
    for bad in ("memory.max_total_tokens", "max_total_tokens=1,2", "memory.page_size=1,,2"):
        with pytest.raises((MemcliError, ConfigError)):
            parse_sweep(bad)


def test_pool_size_values_clear_the_alternative_and_shorten_the_context():
    base = small_config(16, pool=100_000, context=50_000)
    spec = parse_sweep("memory.max_total_tokens=30000,90000")
    assert spec.overrides(30000, base) == ["memory.max_total_tokens=30000", "memory.kv_budget_gib=null",
                                           "memory.max_context_len=30000"]
    assert spec.overrides(90000, base) == ["memory.max_total_tokens=90000", "memory.kv_budget_gib=null"]
    assert parse_sweep("cache.eviction_policy=lfu").overrides("lfu", base) == ["cache.eviction_policy=lfu"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = shrink_mooncake(CONVERSATION, tmp_path_factory.mktemp("s") / "t.jsonl", 40, block_size=32)
    return read_trace(path, block_size=32)


def _make_config(extra):
    raw = small_config(16, pool=60_000, context=60_000).to_dict()
    return config_from_dict(apply_overrides(raw, extra))


def test_reference_is_computed_when_the_pool_would_be_too_large(trace, monkeypatch):
    monkeypatch.setattr(sweep_mod, "UNLIMITED_REPLAY_MAX_TOKENS", 1000)
    shared = shared_prefix_lens(trace)
    result = run_sweep(parse_sweep("cache.eviction_policy=lru"), _make_config, trace, ReplayOptions("sequential"),
                       shared)
    ref = result.reference
    assert ref.method == "computed" and ref.pool_tokens is None
    # Sequential arrivals and no eviction at 60k tokens: the replay reaches the computed ceiling.
    assert ref.hit_rate == result.rows[0].result.prefix.hit_rate == result.rows[0].result.prefix.ceiling_hit_rate


def test_reference_replays_with_every_token_of_the_trace(trace):
    result = run_sweep(parse_sweep("memory.max_total_tokens=12000"), _make_config, trace, ReplayOptions("sequential"),
                       shared_prefix_lens(trace))
    ref = result.reference
    assert ref.method == "replayed" and ref.pool_tokens == unlimited_pool_tokens(trace, 16)
    assert ref.hit_rate == ref.ceiling_hit_rate >= result.rows[0].result.prefix.hit_rate


def test_every_value_is_checked_before_the_first_replay(trace, monkeypatch):
    monkeypatch.setattr(sweep_mod, "replay", lambda *a, **k: pytest.fail("replayed before checking every value"))
    with pytest.raises(CapacityError):
        run_sweep(parse_sweep("memory.max_total_tokens=60000,2000"), _make_config, trace, ReplayOptions("burst"),
                  shared_prefix_lens(trace))
