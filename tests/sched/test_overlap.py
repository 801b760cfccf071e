"""The overlap loop (`semantics.event_loop: overlap`): exact state of the one-step lag, the
extra in-flight slot freed exactly once, and every invariant after every step in both loops."""

import pytest
import torch

from memcli.errors import IntegrityError
from memcli.mem_cache.integrity import InFlightSlot, run_checks
from memcli.sched import overlap
from tests.sched.helpers import small_stack, tokens
from tests.sched.test_scheduler import assert_all_free, make_scheduler, shared_prefix_workload

LOOPS = ("overlap", "normal")


def overlap_scheduler(page_size=1, pool=256, **kw):
    """SGLang 0.5.5's overlap loop (a finishing request decoded once more, its in-flight slot
    freed at that batch's result); 0.5.23 skips that decode (skip_finishing_decode)."""
    kw.setdefault("semantics__engine", "sglang-0.5.5")
    cfg, stack = small_stack(page_size, pool=pool, rows=8, context=128, semantics__event_loop="overlap", **kw)
    return stack, make_scheduler(stack, cfg)


def test_the_profiles_pick_their_loop():
    cfg, _ = small_stack()
    assert cfg.behaviour.event_loop == "overlap"
    cfg, _ = small_stack(semantics__profile="memcli")
    assert cfg.behaviour.event_loop == "normal"
    cfg, stack = small_stack(semantics__profile="memcli", semantics__event_loop="overlap")
    assert make_scheduler(stack, cfg).overlap is not None


def test_a_finish_keeps_its_in_flight_slot_one_step():
    stack, sched = overlap_scheduler()
    size = stack.allocator.size
    sched.add_request(sched.new_req("a", tokens((0, 10)), 2))
    kinds = [sched.step().kind for _ in range(3)]
    # step 0: prefill launched; step 1: decode launched (slot 10), prefill result (1 output);
    # step 2: decode launched (slot 11), decode result: "a" finishes with slot 11 in flight
    assert kinds == ["prefill", "decode", "decode"]
    req = sched.finished[0]
    assert (req.kv_allocated_len, req.kv_committed_len, len(req.output_ids)) == (11, 11, 2)
    assert sched.overlap.in_flight_slots() == [InFlightSlot("a", 11, sched.overlap.in_flight_slots()[0].slot)]
    assert stack.allocator.available_size() + stack.tree_cache.evictable_size() == size - 1
    assert sched.running.reqs == [req]  # leaves the running batch at the next decode update
    record = sched.step()  # no batch; the last decode's result frees the extra slot
    assert record.kind == "idle" and sched.running.reqs == [] and sched.overlap.in_flight_slots() == []
    assert sched.is_done()
    assert_all_free(stack)


@pytest.mark.parametrize("input_len, opens_page", [(31, True), (30, False)])
def test_paged_extra_slot_is_freed_only_when_it_opened_a_page(input_len, opens_page):
    stack, sched = overlap_scheduler(page_size=16)
    sched.add_request(sched.new_req("a", tokens((0, input_len)), 2))
    for _ in range(3):
        sched.step()
    # the extra slot sits at position input_len + 1: 32 opens a page, 31 shares the last one
    assert len(sched.overlap.in_flight_slots()) == (1 if opens_page else 0)
    sched.run()
    assert_all_free(stack)


@pytest.mark.parametrize("event_loop", LOOPS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("cache", ["radix", "chunk"])
def test_both_loops_keep_every_invariant_after_every_step(event_loop, page_size, cache):
    cfg, stack = small_stack(page_size, pool=512, cache=cache, rows=8, context=256, chunk=64,
                             semantics__event_loop=event_loop)
    sched = make_scheduler(stack, cfg, retract_every=4)
    shared_prefix_workload(sched, n=24, max_out=30, gap_ms=0.5)
    sched.run(max_steps=5000)
    assert sched.is_done() and sched.stats.finished == 24
    assert sched.stats.retracted_requests > 0 and sched.stats.checks_run >= sched.step_count
    assert_all_free(stack)


@pytest.mark.parametrize("page_size", [1, 16])
def test_memcli_profile_runs_the_overlap_loop(page_size):
    cfg, stack = small_stack(page_size, pool=512, rows=8, context=256, chunk=32, semantics__profile="memcli",
                             semantics__event_loop="overlap")
    sched = make_scheduler(stack, cfg, retract_every=5)
    shared_prefix_workload(sched, n=16, max_out=30)
    sched.run(max_steps=5000)
    assert sched.stats.finished == 16
    assert_all_free(stack)


def test_a_planted_double_free_of_the_extra_slot_is_caught_at_its_step(monkeypatch):
    """SGLang's bug class (reference §11 items 6 and 9): the in-flight slot freed although its
    page already went with the request's last page. The check after that very step fails."""
    stack, sched = overlap_scheduler(page_size=16, pool=512)
    shared_page = {}  # request -> the slot whose page the release already freed
    planted_at = []
    release, skip = overlap.OverlapLoop.release, overlap.OverlapLoop._skip

    def leaky_release(self, req, why):
        slot = stack.memory.slot_at(req.req_pool_idx, req.kv_allocated_len - 1)
        release(self, req, why)
        flight = next((f for f in self.result_queue if req in f.extra), None)
        if flight is not None and flight.extra[req] is None:
            shared_page[req] = slot

    def double_free(self, flight, req):
        if req in flight.extra and flight.extra[req] is None and req in shared_page:
            planted_at.append(sched.step_count)
            stack.memory.free_in_flight([shared_page.pop(req)])
        return skip(self, flight, req)

    monkeypatch.setattr(overlap.OverlapLoop, "release", leaky_release)
    monkeypatch.setattr(overlap.OverlapLoop, "_skip", double_free)
    sched.add_request(sched.new_req("a", tokens((0, 30)), 2))  # extra slot at 31: shares its page
    with pytest.raises(IntegrityError, match="memory leak detected") as caught:
        sched.run(max_steps=10)
    assert planted_at == [sched.step_count - 1]  # the check right after the planted free
    assert f"= {512 + 16} vs size 512" in str(caught.value)  # one page counted twice
    free_list = {r.name: r for r in run_checks(stack, sched.memory_holders())}["free_list"]
    assert not free_list.ok and "freed twice" in free_list.detail


def test_the_running_batch_is_filtered_only_after_a_finish(monkeypatch):
    """`filter_running` passes over the running requests only when some request finished since
    the batch last held none; the finished request still leaves at the next decode update."""
    stack, sched = overlap_scheduler(pool=512, semantics__engine="sglang-0.5.23")
    passes = []
    real = type(sched.running).filter_batch
    monkeypatch.setattr(type(sched.running), "filter_batch",
                        lambda batch, keep=None: (passes.append(keep), real(batch, keep))[1])
    for start, rid, out in ((0, "a", 3), (100, "b", 6), (200, "c", 9)):
        sched.add_request(sched.new_req(rid, tokens((start, start + 10)), out))
    seen_finish = []
    while not sched.is_done():
        finishes_before, full_before = sched.finish_count, passes.count(None)
        may_hold = sched.running_may_hold_finished()
        sched.step()
        if not may_hold and sched.finish_count == finishes_before:
            assert passes.count(None) == full_before  # no finish since the last pass: none taken
        if sched.finish_count > finishes_before:
            seen_finish.append(sched.step_count)
        assert not any(r.finished for r in sched.running.reqs) or sched.running_may_hold_finished()
    assert sched.finish_count == 3 and len(seen_finish) == 3
    assert passes.count(None) >= 1  # the finishes were filtered out
    assert_all_free(stack)
