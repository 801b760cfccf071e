"""Hit-rate variants, occupancy means and series thinning on hand-made numbers."""

from __future__ import annotations

import numpy as np
import pytest

from memcli.tools.replay.metrics import (DEFINITIONS, EvictionLog, StepSeries, downsample, eviction_stats,
                                   occupancy_stats, prefix_stats, queue_stats)
from memcli.sched.scheduler import StepRecord


def test_prefix_stats_variants():
    inputs = np.array([100, 100, 100, 100], dtype=np.int64)
    cached = np.array([0, 64, 96, -1], dtype=np.int64)  # the last one was never admitted
    shared = np.array([0, 70, 99, 99], dtype=np.int64)
    p = prefix_stats(inputs, cached, shared, page_size=16, block_size=32)
    assert (p.requests, p.input_tokens, p.cached_tokens) == (3, 300, 160)
    assert p.hit_rate == pytest.approx(160 / 300)
    assert (p.hit_blocks, p.blocks) == (0 + 2 + 3, 4 * 3)
    # Warm-up excluded: requests 2 and 3 (trace order); only request 2 was admitted.
    assert (p.warmup_cached_tokens, p.warmup_input_tokens) == (96, 100)
    assert p.shared_tokens == 169 and p.ceiling_tokens == 64 + 96
    assert p.lost_to_page_alignment == 9 and p.lost_to_capacity_and_timing == 0
    assert p.requests_with_hits == 2


def test_sub_page_prefixes_are_counted():
    p = prefix_stats(np.array([50, 50, 50]), np.array([0, 0, 16]), np.array([0, 5, 20]), page_size=16, block_size=512)
    assert p.sub_page_prefix_requests == 1
    assert p.lost_to_page_alignment == 5 + 4


def _record(step, time_ms, running, available, evictable, protected, held_tokens, held_pages):
    return StepRecord(step, time_ms, "decode", running, running, running, 0, available, evictable, protected,
                      held_tokens, held_pages)


def test_occupancy_is_time_weighted_and_counts_partial_pages():
    series = StepSeries()
    series.append(_record(0, 10.0, 1, 64, 16, 0, 20, 3))   # lasts 30 ms
    series.append(_record(1, 40.0, 2, 32, 16, 16, 30, 3))  # lasts 10 ms
    series.append(_record(2, 50.0, 0, 96, 32, 0, 0, 0))    # last: no weight
    arrays = series.arrays(pool_size=128, page_size=16)
    assert arrays["used_tokens"].tolist() == [36, 62, 32]
    assert arrays["used_pages"].tolist() == [4, 6, 2]
    assert arrays["waste_tokens"].tolist() == [28, 18, 0]
    occ = occupancy_stats(arrays, 128, 16)
    assert occ.peak_used_tokens == 62 and occ.peak_used_pages == 6
    assert occ.mean_used_tokens == pytest.approx((36 * 30 + 62 * 10) / 40)
    assert occ.peak_waste_tokens == 28 and occ.mean_waste_tokens == pytest.approx((28 * 30 + 18 * 10) / 40)
    q = queue_stats(arrays)
    assert q.max_running == 2 and q.mean_running == pytest.approx((1 * 30 + 2 * 10) / 40)


def test_downsample_keeps_ends():
    series = {"time_ms": np.arange(10_000, dtype=np.float64), "x": np.arange(10_000)}
    thin = downsample(series, 100)
    assert len(thin["x"]) == 100 and thin["x"][0] == 0 and thin["x"][-1] == 9_999


class _Tree:
    def __init__(self, log):
        self.eviction_log = log


def test_eviction_log_drains_and_summarises():
    from memcli.mem_cache.radix_cache import EvictionRecord

    tree = _Tree([EvictionRecord(16, 100.0, 0), EvictionRecord(32, 300.0, 2), EvictionRecord(16, 200.0, 1)])
    log = EvictionLog()
    log.drain(tree.eviction_log)
    tree.eviction_log.clear()
    assert tree.eviction_log == []
    stats = eviction_stats(log, "lru")
    assert (stats.evictions, stats.tokens_evicted) == (3, 64)
    assert stats.age_ms == {"p50": 200.0, "p90": 280.0, "max": 300.0}
    assert stats.hits_before_eviction["max"] == 2
    assert not stats.future_known and stats.tokens_needed_again == 0


def test_reuse_distance_from_the_last_and_next_use():
    from memcli.mem_cache.radix_cache import EvictionRecord

    # Requests 0..5 admitted at 0, 10, ..., 50 ms; request 4 never admitted (the replay stopped).
    admit_ms = np.array([0.0, 10.0, 20.0, 30.0, np.nan, 50.0])
    tree = _Tree([EvictionRecord(16, 1.0, 0, last_use=1, next_use=3),   # 2 requests, 20 ms later
                  EvictionRecord(32, 1.0, 0, last_use=0, next_use=5),   # 5 requests, 50 ms
                  EvictionRecord(8, 1.0, 0, last_use=2, next_use=-1),   # never needed again
                  EvictionRecord(4, 1.0, 0, last_use=-1, next_use=4)])  # needed, never used before
    log = EvictionLog()
    log.drain(tree.eviction_log)
    tree.eviction_log.clear()
    stats = eviction_stats(log, "lru", admit_ms, future_known=True)
    assert stats.reused_evictions == 3 and stats.tokens_needed_again == 16 + 32 + 4
    assert stats.needed_again_share == pytest.approx(52 / 60)
    assert stats.reuse_distance_requests["max"] == 5 and stats.reuse_distance_requests["p50"] == 3.5
    assert stats.reuse_distance_ms["max"] == 50 and stats.reuse_distance_ms["p50"] == 35


def test_int_column_keeps_a_run_then_spills_in_order():
    from memcli.tools.replay.metrics import IntColumn

    column = IntColumn()
    assert len(column) == 0 and column.numpy().tolist() == []
    column.extend_run(16, 3)
    column.append(16)
    assert column.values is None and len(column) == 4 and column.numpy().tolist() == [16] * 4
    column.append(32)
    column.extend_run(16, 2)
    column.extend_run(8, 0)
    assert column.numpy().tolist() == [16, 16, 16, 16, 32, 16, 16]
    first = IntColumn()
    first.append(-1)
    first.extend_run(5, 2)
    assert first.numpy().tolist() == [-1, 5, 5]


def test_block_evictions_drain_as_their_records_would():
    """vLLM's evicted blocks (one size, no known uses) give the stats a record per block gives."""
    from array import array

    from memcli.mem_cache.block_manager import BlockEvictions
    from memcli.mem_cache.radix_cache import EvictionRecord

    ages, hits = [5.0, 1.0, 9.0, 2.0], [0, 3, 1, 0]
    columns = EvictionLog()
    columns.drain(BlockEvictions(16, array("d", ages[:3]), array("q", hits[:3])))
    columns.drain([])
    columns.drain(BlockEvictions(16, array("d", ages[3:]), array("q", hits[3:])))
    records = EvictionLog()
    records.drain([EvictionRecord(16, a, h) for a, h in zip(ages, hits)])
    admit_ms = np.arange(4, dtype=np.float64)
    assert eviction_stats(columns, "lru", admit_ms, True) == eviction_stats(records, "lru", admit_ms, True)
    assert eviction_stats(columns, "lru").tokens_evicted == 64
    mixed = EvictionLog()  # a run broken by a record of another size: kept entry by entry from there
    mixed.drain(BlockEvictions(16, array("d", [1.0]), array("q", [0])))
    mixed.drain([EvictionRecord(32, 2.0, 1, last_use=0, next_use=3)])
    stats = eviction_stats(mixed, "lru", admit_ms, True)
    assert (stats.evictions, stats.tokens_evicted, stats.tokens_needed_again) == (2, 48, 32)


def test_engine_counters_give_sglang_and_vllm_rates():
    from memcli.tools.replay.metrics import EngineCounters, prefix_stats

    counters = EngineCounters(np.array([0, 30, 10]), np.array([100, 70, 0]), vllm_queries=400, vllm_hits=60)
    p = prefix_stats(np.array([100, 200]), np.array([0, 40]), np.array([0, 40]), 4, 16, counters)
    assert p.batches == 3 and p.batch_mean_hit_rate == pytest.approx((0 + 0.3 + 1.0) / 3)
    assert p.last_batch_hit_rate == 1.0 and p.sglang_cumulative_hit_rate == pytest.approx(40 / 210)
    assert p.vllm_hit_rate == 60 / 400
    assert p.per_request_mean_hit_rate == pytest.approx((0 + 40 / 200) / 2) and p.hit_rate == 40 / 300
    assert (p.hit_pages, p.pages) == (10, 25 + 50)


def test_every_reported_ratio_has_a_definition():
    for key in ("hit_rate", "block_ratio", "warmup_excluded", "last_1000", "ceiling", "lost_to_page_alignment",
                "sub_page_prefix_requests", "lost_to_capacity_and_timing", "per_request_mean", "page_hit_rate",
                "sglang_batch", "sglang_cumulative", "vllm", "belady"):
        assert len(DEFINITIONS[key]) > 40
