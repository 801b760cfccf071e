"""Points of a study: --sweep (repeatable: the product), --sweep-file, and their overrides."""

from __future__ import annotations

import pytest

from memcli.errors import ConfigError, MemcliError
from memcli.tools.study.grid import (grid_points, parse_sweep, point_key, point_label, point_overrides,
                                      read_sweep_file)

from tests.tools.replay.helpers import small_config


def test_parse_sweep_reads_values_as_yaml():
    spec = parse_sweep("memory.max_total_tokens=1000, 2000")
    assert spec.key == "memory.max_total_tokens" and spec.values == (1000, 2000)
    assert parse_sweep("cache.eviction_policy=lru,lfu").values == ("lru", "lfu")
    for bad in ("memory.max_total_tokens", "max_total_tokens=1,2", "memory.page_size=1,,2", "memory.page_size=1,1"):
        with pytest.raises((MemcliError, ConfigError)):
            parse_sweep(bad)


def test_repeated_sweeps_give_the_product_first_key_outermost():
    points = grid_points([parse_sweep("memory.page_size=1,16"), parse_sweep("cache.eviction_policy=lru,lfu,fifo")])
    assert points == [{"memory.page_size": ps, "cache.eviction_policy": p} for ps in (1, 16) for p in ("lru", "lfu", "fifo")]
    with pytest.raises(MemcliError, match="swept twice"):
        grid_points([parse_sweep("memory.page_size=1"), parse_sweep("memory.page_size=16")])


def test_sweep_file_points_dotted_or_nested_times_the_sweeps(tmp_path):
    path = tmp_path / "points.yaml"
    path.write_text("- memory.page_size: 16\n  cache.eviction_policy: lfu\n- memory: {page_size: 1}\n")
    file_points = read_sweep_file(path)
    assert file_points == [{"memory.page_size": 16, "cache.eviction_policy": "lfu"}, {"memory.page_size": 1}]
    points = grid_points([parse_sweep("memory.max_total_tokens=1000,2000")], file_points)
    assert len(points) == 4 and points[1] == {"memory.page_size": 16, "cache.eviction_policy": "lfu",
                                              "memory.max_total_tokens": 2000}
    with pytest.raises(MemcliError, match="set both by --sweep and by the --sweep-file"):
        grid_points([parse_sweep("memory.page_size=1")], file_points)


@pytest.mark.parametrize("text, needle", [
    ("memory.page_size: 16\n", "points.yaml:1: a sweep file is a non-empty YAML list"),
    ("[]\n", "non-empty YAML list"),
    ("- {memory.page_size: 16}\n- 7\n", "points.yaml:2: a point is a non-empty mapping"),
    ("- {page_size: 16}\n", "points.yaml:1: 'page_size' is not a config key"),
    ("- {memory.page_size: 16}\n- {memory: {page_size: 16}}\n", "points.yaml:2: point page_size=16 is listed twice"),
    ("- {memory.page_size: 16\n- {memory.page_size: 1}: x: y\n", "points.yaml:2: not valid YAML"),
])
def test_bad_sweep_files_name_the_line(tmp_path, text, needle):
    path = tmp_path / "points.yaml"
    path.write_text(text)
    with pytest.raises(MemcliError) as info:
        read_sweep_file(path)
    assert needle in info.value.message and info.value.hint


def test_pool_size_values_clear_the_alternative_and_shorten_the_context():
    base = small_config(16, pool=100_000, context=50_000)
    assert point_overrides({"memory.max_total_tokens": 30000}, base) == [
        "memory.max_total_tokens=30000", "memory.kv_budget_gib=null", "memory.max_context_len=30000"]
    assert point_overrides({"memory.max_total_tokens": 90000}, base) == [
        "memory.max_total_tokens=90000", "memory.kv_budget_gib=null"]
    # The page size of the point floors the pool: 30,001 tokens in pages of 64 hold 29,952.
    assert point_overrides({"memory.max_total_tokens": 30001, "memory.page_size": 64}, base)[-1] == \
        "memory.max_context_len=29952"
    assert point_overrides({"cache.eviction_policy": "lfu"}, base) == ["cache.eviction_policy=lfu"]


def test_point_identity_ignores_key_order():
    a = {"memory.page_size": 16, "cache.eviction_policy": "lru"}
    b = {"cache.eviction_policy": "lru", "memory.page_size": 16}
    assert point_key(a) == point_key(b) != point_key({**a, "memory.page_size": 1})
    assert point_label(a) == "page_size=16, eviction_policy=lru"
