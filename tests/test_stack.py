"""The one stack builder: every component takes memory.page_size unless a debug injection says otherwise."""

import pytest

from memcli.errors import ConfigError
from memcli.stack import COMPONENTS, build_stack
from tests.sched.helpers import small_config


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
@pytest.mark.parametrize("cache", ["radix", "hiradix", "chunk", "none"])
def test_every_component_takes_the_config_page_size(page_size, cache):
    stack = build_stack(small_config(page_size, pool=1024, cache=cache))
    assert set(stack.page_sizes().values()) == {page_size}
    # The host pool exists (and holds a page size) only with the hierarchical cache.
    expected = {"config", *COMPONENTS} - (set() if cache == "hiradix" else {"host_pool"})
    assert set(stack.page_sizes()) == expected
    assert stack.kv_pool.rows == stack.allocator.size + page_size


def test_an_injection_changes_exactly_one_component():
    stack = build_stack(small_config(16, pool=1024), page_size_overrides={"tree_cache": 1})
    sizes = stack.page_sizes()
    assert sizes.pop("tree_cache") == 1
    assert set(sizes.values()) == {16}


def test_a_host_pool_injection_needs_the_hierarchical_cache():
    with pytest.raises(ConfigError, match="only cache.kind hiradix has a host pool"):
        build_stack(small_config(16, pool=1024), page_size_overrides={"host_pool": 1})
    stack = build_stack(small_config(16, pool=1024, cache="hiradix"), page_size_overrides={"host_pool": 1})
    # twice the device pool, plus the padding page of SGLang 0.5.23's host pool (the default engine)
    assert stack.page_sizes()["host_pool"] == 1 and stack.host_pool.size == 2048 + 16


def test_null_cache_page_size_is_read_from_a_built_null_cache():
    stack = build_stack(small_config(16, pool=1024, cache="radix"), page_size_overrides={"null_cache": 4})
    assert stack.null_cache.page_size == 4 and stack.page_sizes()["null_cache"] == 4
    assert stack.tree_cache.page_size == 16


def test_tree_cache_injection_without_a_tree_is_refused():
    with pytest.raises(ConfigError, match="tree_cache") as info:
        build_stack(small_config(16, pool=1024, cache="none"), page_size_overrides={"tree_cache": 1})
    assert "null_cache" in info.value.hint


def test_unknown_component_is_refused():
    with pytest.raises(ConfigError, match="scheduller") as info:
        build_stack(small_config(16, pool=1024), page_size_overrides={"scheduller": 1})
    assert "scheduler" in info.value.hint


# -- the eviction order a tree follows ------------------------------------------------------


def _with(engine, policy, kind="radix", **semantics):
    from memcli.config import apply_overrides, config_from_dict

    overrides = [f"semantics.engine={engine}", f"cache.eviction_policy={policy}", f"cache.kind={kind}",
                 *(f"semantics.{k}={v}" for k, v in semantics.items())]
    return config_from_dict(apply_overrides(small_config(16).to_dict(), overrides))


def test_lfu_orders_as_lru_only_where_the_tree_never_counts_hits():
    from memcli.stack import eviction_order

    assert eviction_order(_with("sglang-0.5.5", "lfu")) == "lru"  # 0.5.5: no hit is ever counted
    assert eviction_order(_with("sglang-0.5.23", "lfu", lfu_hits="never")) == "lru"
    assert eviction_order(_with("sglang-0.5.23", "lfu")) == "lfu"  # a hit counted on insert
    assert eviction_order(_with("sglang-0.5.5", "lfu", lfu_hits="count")) == "lfu"
    assert eviction_order(_with("sglang-0.5.5", "lfu", kind="hiradix")) == "lfu"  # write-through counts hits
    for policy in ("lru", "fifo", "belady"):
        assert eviction_order(_with("sglang-0.5.5", policy)) == policy


def _lru_and_lfu(engine, page_size, loop):
    """The replay documents of lru and lfu on the conversation head, whole prompts, a pool of
    200,000 tokens (it evicts and retracts), with the policy's name and the wall clock cleared."""
    from memcli.config import apply_overrides, config_from_dict
    from memcli.tools.replay.report import replay_document
    from memcli.tools.replay.runner import ReplayOptions, default_arrivals, replay
    from memcli.workload.readers import read_trace
    from tests.tools.replay.helpers import CONVERSATION
    from tests.tools.replay.helpers import small_config as replay_config

    trace = read_trace(CONVERSATION)
    docs = {}
    for policy in ("lru", "lfu"):
        raw = replay_config(page_size, pool=200_000, context=200_000, rows=64).to_dict()
        config = config_from_dict(apply_overrides(raw, [f"semantics.engine={engine}", f"semantics.event_loop={loop}",
                                                        f"cache.eviction_policy={policy}"]))
        doc = replay_document(replay(config, trace, ReplayOptions(default_arrivals(trace))))
        assert doc["eviction"]["policy"] == policy and doc["config"]["cache"]["eviction_policy"] == policy
        doc["eviction"]["policy"] = doc["config"]["cache"]["eviction_policy"] = None
        for section, key in (("summary", "wall_time_s"), ("summary", "steps_per_s"), ("integrity", "check_s")):
            doc[section][key] = None
        docs[policy] = doc
    assert docs["lru"]["eviction"]["evictions"] > 0 and docs["lru"]["scheduling"]["retractions"] > 0
    return docs["lru"], docs["lfu"]


@pytest.mark.parametrize("page_size, loop", [(1, "normal"), (1, "overlap"), (16, "overlap")])
def test_where_lfu_orders_as_lru_the_two_replays_are_the_same(page_size, loop):
    """The claim `eviction_order` makes, replayed: under sglang-0.5.5 the whole documents of lfu
    and lru agree, the policy's name and the wall clock aside."""
    lru, lfu = _lru_and_lfu("sglang-0.5.5", page_size, loop)
    assert lfu == lru


def test_where_hits_are_counted_the_same_comparison_tells_lfu_from_lru():
    """The comparison above can fail: 0.5.23 counts a hit on insert, and on the same pool its lfu
    evicts other leaves than its lru."""
    lru, lfu = _lru_and_lfu("sglang-0.5.23", 1, "overlap")
    assert lfu["eviction"]["evictions"] != lru["eviction"]["evictions"]
