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
