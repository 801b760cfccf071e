"""End-to-end scheduler runs on tiny CPU pools with the integrity check after every step."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memcli.mem_cache.integrity import memory_reports
from memcli.sched.batch import ScheduleBatch
from memcli.sched.scheduler import Scheduler
from tests.sched.helpers import scheduler_for, small_stack, tokens


def make_scheduler(stack, cfg, **kw):
    kw.setdefault("check_every_step", True)
    return scheduler_for(stack, cfg, page_size=stack.scheduler_page_size, **kw)


def assert_all_free(stack):
    reports = memory_reports(stack, [])
    assert all(r.ok for r in reports), "\n".join(str(r) for r in reports)
    assert stack.allocator.available_size() + stack.tree_cache.evictable_size() == stack.allocator.size
    assert stack.tree_cache.protected_size() == 0
    assert stack.req_to_token_pool.available_size() == stack.req_to_token_pool.size


def shared_prefix_workload(sched, n=24, seed=0, prefix_len=60, max_tail=50, max_out=20, gap_ms=2.0):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 1000, prefix_len)
    for i in range(n):
        ids = np.concatenate([system[: rng.integers(0, prefix_len + 1)], rng.integers(1000, 5000, rng.integers(1, max_tail))])
        sched.add_request(sched.new_req(f"r{i}", ids, int(rng.integers(1, max_out)), arrival_ms=i * gap_ms))


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("cache", ["radix", "chunk"])
def test_shared_prefixes_under_pressure_end_free(page_size, cache):
    cfg, stack = small_stack(page_size, pool=512, cache=cache, rows=8, context=256, chunk=64)
    sched = make_scheduler(stack, cfg)
    shared_prefix_workload(sched)
    sched.run(max_steps=3000)
    assert sched.is_done()
    assert sched.stats.finished == 24 and sched.stats.aborted == 0
    assert sched.stats.checks_run >= sched.step_count
    assert_all_free(stack)
    cached = sum(r.first_cached_tokens for r in sched.finished)
    if cache == "radix":
        assert cached > 0
        assert all(r.first_cached_tokens % page_size == 0 for r in sched.finished)
    else:
        assert cached == 0


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_forced_retraction_every_few_steps(page_size):
    cfg, stack = small_stack(page_size, pool=1024, rows=8, context=256, chunk=64)
    sched = make_scheduler(stack, cfg, retract_every=3)
    shared_prefix_workload(sched, n=16, max_out=30, gap_ms=0.0)
    sched.run(max_steps=5000)
    assert sched.stats.forced_retractions > 0 and sched.stats.retracted_requests > 0
    assert sched.stats.finished == 16
    assert all(len(r.output_ids) == r.max_new_tokens for r in sched.finished)
    assert_all_free(stack)


@pytest.mark.parametrize("page_size", [1, 4])
def test_memory_pressure_forces_eviction_and_retraction(page_size):
    # memcli's admission budget is rebuilt every step, so this workload over-admits and must
    # retract; SGLang's batch_is_full gate admits fewer here (the step-level differential
    # tests cover that profile's retractions).
    cfg, stack = small_stack(page_size, pool=256, rows=8, context=200, chunk=32, semantics__profile="memcli",
                             scheduler__init_new_token_ratio=0.01, scheduler__min_new_token_ratio_factor=0.01)
    sched = make_scheduler(stack, cfg)
    for i in range(8):
        sched.add_request(sched.new_req(f"r{i}", tokens((0, 40), (1000 * (i + 1), 10)), 60))
    sched.run(max_steps=5000)
    assert sched.stats.retractions > 0
    assert sched.stats.finished == 8
    evicted = sum(e.tokens for e in sched.events if e.kind == "evict")
    assert evicted == stack.tree_cache.evicted_tokens_total > 0
    assert_all_free(stack)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("cache", ["radix", "chunk"])
def test_chunked_prefill_of_a_long_prompt(page_size, cache):
    cfg, stack = small_stack(page_size, pool=512, cache=cache, rows=4, context=400, chunk=32)
    sched = make_scheduler(stack, cfg)
    sched.add_request(sched.new_req("long", tokens((0, 301)), 5))
    seen_chunks = []
    while not sched.is_done():
        record = sched.step()
        if record.kind == "prefill":
            seen_chunks.append(record.new_tokens)
    assert len(seen_chunks) == 10  # ceil(301 / 32)
    assert all(n == 32 for n in seen_chunks[:-1])
    assert_all_free(stack)
    if cache == "radix":
        expected = (301 + 5 - 1) // page_size * page_size  # prompt + output, minus the last token
        assert stack.tree_cache.total_size() == expected


def test_match_is_capped_before_matching():
    cfg, stack = small_stack(1, pool=256)
    sched = make_scheduler(stack, cfg)
    sched.add_request(sched.new_req("a", tokens((0, 20)), 1))
    sched.run()
    req = sched.new_req("b", tokens((0, 20)), 1)
    req.init_next_round_input(stack.memory)
    assert len(req.prefix_indices) == 19 and req.extend_input_len == 1
    assert req.prefix_indices.dtype.is_floating_point is False


def test_prefix_indices_default_is_empty_int64_on_device():
    cfg, stack = small_stack(1, pool=64)
    req = make_scheduler(stack, cfg).new_req("a", tokens((0, 3)), 1)
    assert req.prefix_indices.numel() == 0
    assert str(req.prefix_indices.dtype) == "torch.int64" and req.prefix_indices.device == stack.device


def test_retract_victims_fewest_outputs_then_longest_prompt():
    cfg, stack = small_stack(1, pool=512, rows=8)
    sched = make_scheduler(stack, cfg, check_every_step=False)
    specs = [("a", 10, 3), ("b", 30, 1), ("c", 20, 1), ("d", 5, 2)]
    reqs = [sched.new_req(rid, tokens((100 * i, n)), 50) for i, (rid, n, _) in enumerate(specs)]
    for r in reqs:
        r.init_next_round_input(stack.memory)
        stack.tree_cache.inc_lock_ref(r.last_node)
    batch = ScheduleBatch(reqs, stack.memory)
    batch.prepare_for_extend()
    for r, (_, _, outs) in zip(reqs, specs):
        r.kv.kv_committed_len = r.kv_allocated_len
        r.output_ids = list(range(outs))
    order = sorted(range(4), key=lambda i: (len(reqs[i].output_ids), -reqs[i].input_len), reverse=True)
    assert [reqs[i].rid for i in reversed(order)] == ["b", "c", "d", "a"]
    retracted, ratio = batch.retract_decode(retract_decode_steps=20)
    assert [r.rid for r in retracted] == ["b"]  # memory was fine: exactly one victim
    assert [r.rid for r in batch.reqs] == ["a", "d", "c"] or sorted(r.rid for r in batch.reqs) == ["a", "c", "d"]
    assert 0 < ratio <= 1.0


def test_prefill_budget_respects_max_running_and_input_budget():
    cfg, stack = small_stack(1, pool=4096, rows=3, context=512, chunk=None, scheduler__max_prefill_tokens=100)
    sched = make_scheduler(stack, cfg)
    for i in range(5):
        sched.add_request(sched.new_req(f"r{i}", tokens((1000 * i, 60)), 3))
    first = sched.step()
    # 60 new tokens fit the 100-token budget, a second request would exceed it.
    assert first.kind == "prefill" and first.batch_size == 1
    sched.run()
    assert sched.stats.peak_request_rows <= 3
    assert_all_free(stack)


def test_only_one_request_is_chunked_at_a_time_and_chunks_are_page_aligned():
    cfg, stack = small_stack(4, pool=2048, rows=4, context=512, chunk=40)
    sched = make_scheduler(stack, cfg)
    for i in range(3):
        sched.add_request(sched.new_req(f"r{i}", tokens((1000 * i, 150)), 2))
    while not sched.is_done():
        sched.step()
        chunked = [r for r in sched.active_reqs() if r is sched.chunked_req]
        assert len(chunked) <= 1
        if sched.chunked_req is not None:
            assert sched.chunked_req.kv_allocated_len % 4 == 0
    assert_all_free(stack)


def test_abort_releases_everything():
    cfg, stack = small_stack(4, pool=512, rows=4, context=256, chunk=32)
    sched = make_scheduler(stack, cfg)
    shared_prefix_workload(sched, n=6, gap_ms=0.0)
    for _ in range(4):
        sched.step()
    victims = [r.rid for r in sched.active_reqs()][:2] + [sched.waiting[0].rid if sched.waiting else "r5"]
    for rid in victims:
        assert sched.abort(rid)
    sched.run()
    assert sched.stats.aborted == 3
    assert_all_free(stack)


@pytest.mark.parametrize("engine, event_loop, allocs", [("sglang-0.5.5", "normal", 3), ("sglang-0.5.5", "overlap", 4),
                                                        ("sglang-0.5.23", "normal", 3), ("sglang-0.5.23", "overlap", 3)])
def test_events_record_the_lifecycle(engine, event_loop, allocs):
    """0.5.5's overlap loop launches one more decode before the result that finishes the
    request; 0.5.23's leaves a request its in-flight result finishes out of the decode."""
    cfg, stack = small_stack(1, pool=512, semantics__event_loop=event_loop, semantics__engine=engine)
    sched = make_scheduler(stack, cfg)
    sched.add_request(sched.new_req("a", tokens((0, 10)), 3))
    sched.run()
    kinds = [e.kind for e in sched.events]
    assert kinds[:3] == ["arrive", "admit", "alloc"]
    # overlap: one more decode is launched before the result that finishes the request
    assert kinds.count("alloc") == allocs and "finish" in kinds[-2:]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    cache=st.sampled_from(["radix", "chunk"]),
    pool_pages=st.integers(16, 48),
    requests=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(1, 30), st.integers(1, 12), st.integers(0, 5)),
        min_size=1, max_size=10,
    ),
    retract_every=st.sampled_from([0, 0, 2, 5]),
    policy=st.sampled_from(["fcfs", "lpm"]),
)
def test_random_workloads_keep_every_invariant(page_size, cache, pool_pages, requests, retract_every, policy):
    pool = max(pool_pages * 16, 128)
    cfg, stack = small_stack(page_size, pool=pool, cache=cache, rows=4, context=128, chunk=16 if page_size <= 16 else page_size,
                             scheduler__policy=policy)
    sched = make_scheduler(stack, cfg, retract_every=retract_every)
    prefixes = [np.arange(p * 100, p * 100 + 40) for p in range(4)]
    for i, (p, plen, tail, out, gap) in enumerate(requests):
        ids = np.concatenate([prefixes[p][:plen], np.arange(10_000 + 100 * i, 10_000 + 100 * i + tail)])
        sched.add_request(sched.new_req(f"r{i}", ids, out, arrival_ms=float(i * gap)))
    sched.run(max_steps=4000)
    assert sched.is_done()
    assert sched.stats.finished + sched.stats.aborted == len(requests)
    assert sched.stats.aborted == 0
    assert_all_free(stack)


def test_a_request_that_can_never_fit_is_aborted_and_the_rest_runs():
    """The head request's prompt and output exceed the pool: nothing could ever make room, so
    it is aborted (SGLang would wait forever), and the admission gate opens for the next."""
    cfg, stack = small_stack(1, pool=256, rows=8, context=250, semantics__profile="memcli")
    sched = make_scheduler(stack, cfg)
    sched.add_request(sched.new_req("big", tokens((0, 200)), 100))
    sched.add_request(sched.new_req("small", tokens((1000, 10)), 5))
    sched.run(max_steps=200)
    assert sched.is_done()
    assert [(r.rid, r.aborted) for r in sched.finished] == [("big", True), ("small", False)]
    assert_all_free(stack)


def test_sglang_request_limits_clip_the_output_and_abort_long_prompts():
    """Under SGLang's request limits (max_req_len = min(context, pool) - 1 = 249) the same
    request runs with its output clipped to 249 - 200 - 1 = 48 tokens; a prompt of
    max_req_len - 5 = 244 tokens or more is aborted on arrival, one token shorter runs."""
    cfg, stack = small_stack(1, pool=256, rows=8, context=250, semantics__profile="sglang-0.5.5")
    sched = make_scheduler(stack, cfg)
    assert cfg.max_req_len == 249
    sched.add_request(sched.new_req("big", tokens((0, 200)), 100))
    sched.add_request(sched.new_req("long", tokens((300, 244)), 3))
    sched.add_request(sched.new_req("edge", tokens((600, 243)), 3))
    sched.run(max_steps=400)
    assert sched.is_done()
    done = {r.rid: r for r in sched.finished}
    assert not done["big"].aborted and len(done["big"].output_ids) == 48
    assert done["long"].aborted and not done["edge"].aborted
    assert len(done["edge"].output_ids) == 3  # 249 - 243 - 1 = 5 allows all 3
    assert_all_free(stack)
    memcli_cfg, _ = small_stack(1, pool=256, rows=8, context=250, semantics__profile="memcli")
    assert memcli_cfg.max_req_len is None
