"""The scheduler with the host tier (cache.kind hiradix) on tiny CPU pools: load-backs at
admission, their simulated time, when copies are acknowledged, checks after every step."""

import pytest

from memcli.sched.scheduler import Scheduler
from tests.sched.helpers import scheduler_for, small_stack, tokens
from tests.sched.test_scheduler import assert_all_free, shared_prefix_workload


def make(page_size=1, pool=256, loop="normal", ack="prefill_attempt", policy="write_through", **kw):
    # SGLang 0.5.5's host tier (HiRadixCache): its decisions and timings are what these tests pin.
    extra = {"semantics__engine": "sglang-0.5.5", "semantics__event_loop": loop, "semantics__hicache_ack": ack,
             "cache__write_policy": policy,
             "model__num_layers": 1, "model__num_kv_heads": 1, "model__head_dim": 4, "model__dtype": "float32",
             **kw}
    cfg, stack = small_stack(page_size, pool=pool, cache="hiradix", rows=8, context=128, **extra)
    return cfg, stack, scheduler_for(stack, cfg, page_size=stack.scheduler_page_size, check_every_step=True)


def run_one(sched, rid, ids, out=2, at=None):
    sched.add_request(sched.new_req(rid, ids, out, arrival_ms=sched.clock_ms if at is None else at))
    sched.run()
    req = sched.finished[-1]
    assert req.rid == rid
    return req


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_an_evicted_prefix_is_loaded_back_at_admission(page_size, loop):
    cfg, stack, sched = make(page_size, pool=128, loop=loop)
    first = tokens((0, 64))
    run_one(sched, "a", first)
    run_one(sched, "filler", tokens((1000, 100)))  # pushes "a" out of the device pool
    tree = stack.tree_cache
    assert tree.host_size() >= 64 and tree.evicted_tokens_total >= 64
    again = run_one(sched, "b", tokens((0, 64), (5000, 8)))
    assert again.first_cached_tokens == 64 and again.host_loaded_len == 64 and again.first_host_skipped == 0
    assert tree.loaded_back_tokens == 64
    tree.finish_copies()
    assert_all_free(stack)


def test_a_short_host_hit_is_recomputed():
    cfg, stack, sched = make(pool=128, cache__load_back_threshold=100)
    run_one(sched, "a", tokens((0, 64)))
    run_one(sched, "filler", tokens((1000, 100)))
    again = run_one(sched, "b", tokens((0, 64), (5000, 8)))
    assert again.first_cached_tokens == 0 and again.host_loaded_len == 0 and again.first_host_skipped == 64


def test_a_load_back_delays_its_prefill_by_the_copy_time():
    # 32 bytes per token at 0.001 GB/s: 32 us per token, 64 tokens -> 2.048 ms + 2 ms latency.
    cfg, stack, sched = make(pool=128, sim__host_bandwidth_gbps=0.001, sim__host_latency_us=2000.0,
                             sim__step_base_ms=0.5, sim__prefill_token_us=1.0)
    run_one(sched, "a", tokens((0, 64)))
    run_one(sched, "filler", tokens((1000, 100)))
    stack.tree_cache.finish_copies()  # the filler's backup is done: it can be evicted for the load
    sched.add_request(sched.new_req("b", tokens((0, 64), (5000, 8)), 2, arrival_ms=sched.clock_ms))
    start = sched.clock_ms
    while not sched.records or sched.records[-1].kind != "prefill" or sched.records[-1].time_ms <= start:
        sched.step()
    prefill = sched.records[-1]
    load_ms = 2.0 + 64 * 32 / 1e3
    compute_ms = 0.5 + 8 * 1e-3 + 64 * 20 / 1e6  # base + 8 new tokens + 64 cached tokens read
    assert prefill.time_ms - start == pytest.approx(load_ms)  # the load, not the compute
    assert stack.tree_cache.controller.stats.load_wait_ms == pytest.approx(load_ms - compute_ms)
    assert prefill.h2d_bytes == 64 * 32


def test_acknowledgements_wait_for_a_prefill_attempt_under_sglang():
    cfg, stack, sched = make(pool=256, ack="prefill_attempt", policy="write_through")
    sched.add_request(sched.new_req("a", tokens((0, 32)), 6))
    for _ in range(4):  # prefill, then decode steps with nothing waiting: no prefill attempt
        sched.step()
    assert stack.tree_cache.ongoing_write and stack.tree_cache.copy_protected_size() > 0
    cfg, stack, sched = make(pool=256, ack="every_step", policy="write_through")
    sched.add_request(sched.new_req("a", tokens((0, 32)), 6))
    for _ in range(4):
        sched.step()
    assert not stack.tree_cache.ongoing_write


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefixes_under_pressure_end_free(policy, page_size):
    cfg, stack, sched = make(page_size, pool=512, loop="overlap", policy=policy, cache__host_ratio=1.5,
                             scheduler__chunked_prefill_size=64)
    shared_prefix_workload(sched, n=30)
    sched.run()
    assert sched.stats.finished == 30
    stack.tree_cache.finish_copies()
    assert_all_free(stack)
    if policy == "write_back":
        assert stack.tree_cache.written_back_nodes > 0
    else:
        assert stack.tree_cache.backed_up_tokens > 0
