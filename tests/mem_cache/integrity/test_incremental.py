"""Incremental integrity: the ownership ledger against the full walk, and planted faults caught
at the step (and by the check) where they happen."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memcli.mem_cache.manager import MemoryManager
from memcli.mem_cache.integrity import CheckPolicy, IntegrityChecker, OwnershipError
from memcli.mem_cache.integrity.ownership import FREE, TREE
from memcli.mem_cache.radix_cache import RadixCache
from memcli.sched.scheduler import Scheduler
from tests.sched.helpers import scheduler_for, small_stack
from tests.sched.test_scheduler import shared_prefix_workload

PROFILES = ["sglang-0.5.5", "memcli"]


def scheduler(page_size=4, cache="radix", profile="sglang-0.5.5", every_step="incremental", loop=None,
              engine="sglang-0.5.5", **kw):
    extra = {} if loop is None else {"semantics__event_loop": loop}
    # SGLang 0.5.5's engine (its release paths are the ones the planted faults name).
    cfg, stack = small_stack(page_size, pool=512, cache=cache, rows=8, context=256, chunk=64,
                             semantics__engine=engine, semantics__profile=profile, **extra)
    checker = IntegrityChecker(stack, CheckPolicy(every_step, walk_every=1))
    sched = scheduler_for(stack, cfg, page_size=page_size, checker=checker, **kw)
    shared_prefix_workload(sched, max_out=30)
    return stack, sched


def story(err: OwnershipError) -> list[tuple]:
    """The failure's history as (step, rid, op, what) per touch, oldest first."""
    return [(t.step, t.rid, t.op, t.what) for t in err.history]


def run_until(sched, step: int) -> None:
    while sched.step_count < step:
        sched.step()


def failing_step(sched) -> OwnershipError:
    with pytest.raises(OwnershipError) as info:
        sched.run(max_steps=5000)
    return info.value


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("cache", ["radix", "chunk"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_ledger_agrees_with_the_full_walk_at_every_step(page_size, cache, profile):
    """Mode "both": the incremental check and the full walk after every step, and the ledger
    compared page by page with what the walk sees (chunks, retractions, evictions included)."""
    stack, sched = scheduler(page_size, cache, profile, every_step="both", retract_every=3)
    sched.run(max_steps=5000)
    assert sched.is_done() and sched.stats.finished == 24
    stats = sched.checker.stats
    assert stats.incremental == stats.full_walks == sched.step_count
    ledger = sched.checker.ledger
    assert ledger.counts[FREE] * page_size == stack.allocator.available_size()
    assert ledger.counts[TREE] * page_size == stack.tree_cache.total_size()
    assert not ledger.row_pages.any()


@pytest.mark.parametrize("cache", ["radix", "chunk"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_ledger_agrees_with_the_full_walk_under_0523(page_size, cache):
    """The same under SGLang 0.5.23: its request table has a padding row 0 (size + 1 rows, the
    rows handed out from the tail), which the ledger covers."""
    stack, sched = scheduler(page_size, cache, "sglang-0.5.23", every_step="both", retract_every=3,
                             engine="sglang-0.5.23")
    assert stack.req_to_token_pool.req_to_token.shape[0] == stack.req_to_token_pool.size + 1
    sched.run(max_steps=5000)
    assert sched.is_done() and sched.stats.finished == 24
    assert sched.checker.stats.incremental == sched.checker.stats.full_walks == sched.step_count
    assert not sched.checker.ledger.row_pages.any()


def test_no_ledger_without_incremental_checks():
    stack, sched = scheduler(every_step="none")
    sched.run(max_steps=5000)
    assert stack.allocator.ledger is None and stack.req_to_token_pool.ledger is None
    assert sched.checker.stats.incremental == 0


def test_free_of_a_slot_still_in_use_is_caught_by_the_free():
    stack, sched = scheduler()
    run_until(sched, 6)
    req = sched.active_reqs()[0]
    slot = int(stack.req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_allocated_len - 1])
    with pytest.raises(OwnershipError) as info:
        stack.allocator.free(torch.tensor([slot]))
    err = info.value
    assert err.step == 6 and err.check == "double_free"
    assert f"page {slot // 4}" in str(err) and f"request row {req.req_pool_idx}" in str(err)
    assert "allocator.free" in str(err)
    # The story: the page was allocated for this request's extend, then freed behind its back.
    first, *_, last = err.history
    assert {t.page for t in err.history} == {slot // 4}
    assert (first.rid, first.op, first.what, first.src) == (req.rid, "alloc_for_extend", "allocated for an extend", "free")
    assert first.dst == f"request row {req.req_pool_idx}" and first.step < 6
    assert (last.step, last.rid, last.op, last.what, last.dst) == (6, None, "allocator.free", "double free", "refused")
    assert last.src == f"request row {req.req_pool_idx}"
    assert f"history of page {slot // 4} (slots" in str(err) and "allocator.free REFUSED (double free)" in str(err)


@pytest.mark.parametrize("profile", PROFILES)
def test_double_free_by_the_cache_is_caught_at_its_step(profile, monkeypatch):
    """A cache that frees a request's duplicates twice: the second free meets a free page."""
    stack, sched = scheduler(profile=profile)
    planted = []
    free = RadixCache._free

    def free_twice(self, slots, row, op):
        free(self, slots, row, op)
        if len(slots) and sched.step_count >= 5 and not planted:
            planted.append(sched.step_count)
            owners.append((releasing[-1].rid, op, int(slots[0]) // 4))
            self.allocator.free(slots)

    def finishing(self, req, **kw):
        releasing.append(req)
        return cache_finished_req(self, req, **kw)

    owners, releasing, cache_finished_req = [], [], RadixCache.cache_finished_req
    monkeypatch.setattr(RadixCache, "_free", free_twice)
    monkeypatch.setattr(RadixCache, "cache_finished_req", finishing)
    err = failing_step(sched)
    assert planted and err.step == planted[0] == sched.step_count
    assert err.check == "double_free" and "is owned by free" in str(err)
    # The story of the page: allocated for the request, freed by its release, then freed again.
    (rid, op, page), = owners
    *_, alloc, freed, again = story(err)
    assert alloc[1:] == (rid, "alloc_for_extend", "allocated for an extend") and alloc[0] < planted[0]
    assert freed == (planted[0], rid, op, "freed at finish" if op == "cache_finished_req" else freed[3])
    assert again == (planted[0], rid, "allocator.free", "double free")
    assert {t.page for t in err.history} == {page} and err.history[-1].src == "free"


@pytest.mark.parametrize("profile", PROFILES)
def test_lost_page_is_caught_when_its_request_is_released(profile, monkeypatch):
    """cache_finished_req forgets to free a request's tail: the row goes back still owning it."""
    stack, sched = scheduler(page_size=4, profile=profile)
    planted = []
    free = RadixCache._free

    def forgetful(self, slots, row, op):
        if op == "cache_finished_req" and len(slots) and sched.step_count >= 4 and not planted:
            planted.append(sched.step_count)
            rids.append(releasing[-1].rid)
            return
        free(self, slots, row, op)

    def finishing(self, req, **kw):
        releasing.append(req)
        return cache_finished_req(self, req, **kw)

    rids, releasing, cache_finished_req = [], [], RadixCache.cache_finished_req
    monkeypatch.setattr(RadixCache, "_free", forgetful)
    monkeypatch.setattr(RadixCache, "cache_finished_req", finishing)
    err = failing_step(sched)
    assert planted and err.step == planted[0] and err.check == "lost_page"
    assert "still owns" in str(err) and "never freed" in str(err)
    # Allocated for the request, and the release of its row is refused: nothing freed it.
    *_, alloc, refused = story(err)
    assert alloc[1:] == (rids[0], "alloc_for_extend", "allocated for an extend") and alloc[0] < planted[0]
    assert refused == (planted[0], rids[0], "free request row", "lost page")
    assert err.history[-1].src.startswith("request row")


@pytest.mark.parametrize("profile", PROFILES)
def test_misaligned_row_is_caught_by_row_layout_at_its_step(profile, monkeypatch):
    """A decode write that puts a slot at the wrong offset of its page (a kernel bug). In the
    normal loop: the request written to is then still running, so its row is checked."""
    stack, sched = scheduler(page_size=16, profile=profile, loop="normal")
    planted = []
    alloc_decode = MemoryManager.alloc_decode

    def misaligned(memory, reqs, **kw):
        out = alloc_decode(memory, reqs, **kw)
        pool, allocator = memory.req_to_token_pool, memory.allocator
        if sched.step_count >= 8 and not planted:
            row, col = int(kw["req_pool_indices"][0]), int(kw["seq_lens_cpu"][0])
            slot = int(pool.req_to_token[row, col])
            pool.req_to_token[row, col] = slot + 1 if (slot + 1) % 16 else slot - 1
            planted.append(sched.step_count)
        return out

    monkeypatch.setattr(MemoryManager, "alloc_decode", misaligned)
    err = failing_step(sched)
    assert planted and err.step == planted[0] and err.check == "row_layout"
    assert "expected offset" in str(err) or "expected" in str(err)
    # The page of the misplaced slot: whose it is, since when (the write itself moves no owner).
    (page,) = {t.page for t in err.history}
    assert f"of page {page}," in err.message and err.history[0].op == "alloc_for_extend"
    assert err.history[0].rid in err.message and err.history[0].step < planted[0]


def test_a_page_owned_twice_tells_who_owned_it_first():
    """A page of a running request slips back onto the free list behind the ledger: when the
    allocator hands it out again, the story runs from its first extend through the tree."""
    stack, sched = scheduler(page_size=4)
    run_until(sched, 5)
    req = sched.active_reqs()[0]
    slot = int(stack.req_to_token_pool.req_to_token[req.req_pool_idx, 0])
    allocator = stack.allocator
    ledger, allocator.ledger = allocator.ledger, None
    allocator.free(torch.tensor([slot]))  # unseen by the ledger
    allocator.ledger = ledger
    err = failing_step(sched)
    assert err.check == "owned_twice" and err.step == 5
    steps = [t.step for t in err.history]
    assert steps == sorted(steps) and {t.page for t in err.history} == {slot // 4}
    ops = [(t.rid, t.op, t.src, t.dst) for t in err.history]
    # Its first chunk's row (a chunked request takes a new row for each piece): then into the tree.
    assert ops[0][:3] == (req.rid, "alloc_for_extend", "free") and ops[0][3].startswith("request row")
    assert ops[1] == (req.rid, "cache_unfinished_req", ops[0][3], "the tree")
    assert "matched as a prefix and locked" in err.history[2].what and err.history[2].op == "match_prefix"
    assert ops[-1] == (None, "allocator.alloc", "the tree", "refused") and err.history[-1].step == 5


def test_no_history_is_kept_without_a_ledger():
    stack, sched = scheduler(every_step="full")
    sched.run(max_steps=5000)
    assert sched.checker.ledger is None and stack.allocator.ledger is None


def test_page_allocated_and_never_claimed_is_a_lost_page_at_the_next_check():
    stack, sched = scheduler(page_size=4)
    run_until(sched, 5)
    stack.allocator.alloc(4)  # out of the allocator, owned by nobody
    err = failing_step(sched)
    assert err.step == 5 and err.check in ("conservation", "lost_page")
    assert "memory leak detected" in str(err)


def test_full_walks_on_idle_steps_are_sampled():
    cfg, stack = small_stack(4, pool=512, rows=8, context=256, chunk=64)
    checker = IntegrityChecker(stack, CheckPolicy("none", walk_every=4, walk_budget=1.0))
    sched = scheduler_for(stack, cfg, page_size=4, checker=checker)
    shared_prefix_workload(sched, n=12, max_out=3, gap_ms=200.0)  # idle gaps between requests
    sched.run(max_steps=5000)
    idle = sched.stats.idle_steps
    assert idle >= 8
    assert checker.stats.full_walks == 1 + (idle - 1) // 4


def test_policy_rejects_unknown_modes():
    with pytest.raises(ValueError, match="every_step"):
        CheckPolicy("sometimes")
    with pytest.raises(ValueError, match="walk_every"):
        CheckPolicy("none", walk_every=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_check_step_and_step_failure_judge_alike(page_size, monkeypatch):
    """`check_step` (every result, the passes written up) and `step_failure` (what the checker
    calls: the first failure only) agree at every step."""
    from memcli.mem_cache.integrity import checker as checker_module, incremental

    seen = []

    def both(ledger, stack, running):
        dirty = list(ledger.dirty)
        results = incremental.check_step(ledger, stack, running)
        ledger.dirty = dirty
        failure = incremental.step_failure(ledger, stack, running)
        first = next((r for r in results if not r.ok), None)
        assert [r.name for r in results] == list(incremental.INCREMENTAL_NAMES)
        assert (failure is None) == (first is None)
        assert first is None or (failure.name, failure.detail) == (first.name, first.detail)
        seen.append(results)
        return failure

    monkeypatch.setattr(checker_module, "step_failure", both)
    stack, sched = scheduler(page_size=page_size, retract_every=3)
    sched.run(max_steps=5000)
    assert sched.is_done() and len(seen) == sched.step_count
    assert all(r.ok and r.detail for results in seen for r in results)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("fault", ["past the pool", "page 0", "another request's page"])
def test_a_bad_slot_written_into_a_row_is_caught_at_its_step(page_size, fault, monkeypatch):
    """A decode write of a slot outside the pool (slot_range) or of another running request's
    page (page_sharing): caught by the check of the step that wrote it."""
    stack, sched = scheduler(page_size=page_size, loop="normal")
    planted = []
    alloc_decode = MemoryManager.alloc_decode

    def bad_slot(memory, reqs, **kw):
        out = alloc_decode(memory, reqs, **kw)
        pool, allocator = memory.req_to_token_pool, memory.allocator
        rows = kw["req_pool_indices"]
        row, col = int(rows[0]), int(kw["seq_lens_cpu"][0])
        # Another request's page goes at the start of a page (mid-page, row_layout sees it first).
        page_start = fault != "another request's page" or col % page_size == 0
        if sched.step_count >= 8 and not planted and len(rows) >= 2 and page_start:
            if fault == "past the pool":
                slot = allocator.size + page_size * 3 + col % page_size
            elif fault == "page 0":
                slot = col % page_size
            else:
                slot = int(pool.req_to_token[int(rows[1]), int(kw["seq_lens_cpu"][1])])
                slot -= slot % page_size  # the right offset (0): only the owner is wrong
            pool.req_to_token[row, col] = slot
            planted.append(sched.step_count)
        return out

    monkeypatch.setattr(MemoryManager, "alloc_decode", bad_slot)
    err = failing_step(sched)
    assert planted and err.step == planted[0]
    assert err.check == ("page_sharing" if fault == "another request's page" else "slot_range")


def _layout_by_definition(ps, slots, spans):
    """row_layout's first bad entry by its definition, a division per position: -1 for none."""
    pos = [int(p) for p in spans.pos()]
    firsts = set(int(o) for o in spans.offsets)
    for i, (slot, t) in enumerate(zip(slots.tolist(), pos)):
        if slot % ps != t % ps:
            return i
        if i not in firsts and t % ps != 0 and slot != int(slots[i - 1]) + 1:
            return i
    return -1


@pytest.mark.parametrize("ps", [2, 3, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_row_layout_finds_the_first_bad_position_of_its_definition(ps, seed):
    """The vectorised row layout check (low bits for a power-of-two page, one pass for the
    runs) reports the position the definition finds first, with the same message kind: a slot
    off its offset, or a page continued with another slot; spans of several rows, negative
    and out-of-pool slots included."""
    from memcli.mem_cache.integrity.incremental import _layout, _Spans

    rng = np.random.default_rng(seed)
    for _ in range(40):
        k = int(rng.integers(1, 6))
        rows = np.arange(k, dtype=np.int64)
        starts = rng.integers(0, 3 * ps, size=k).astype(np.int64)
        lens = rng.integers(1, 4 * ps, size=k).astype(np.int64)
        spans = _Spans(rows, starts, lens, np.zeros(k, dtype=np.int64))
        parts = []
        for start, n in zip(starts.tolist(), lens.tolist()):  # a valid layout: pages laid out slot by slot
            first_page = int(rng.integers(1, 50))
            t = np.arange(start, start + n)
            page = first_page + (t // ps) * int(rng.integers(1, 3))
            parts.append(page * ps + t % ps)
        slots = np.concatenate(parts).astype(np.int32)
        if rng.random() < 0.7:  # plant one to three faults
            for _ in range(int(rng.integers(1, 4))):
                slots[int(rng.integers(0, len(slots)))] += int(rng.choice([-ps - 1, -1, 1, ps, 7 * ps + 1, -10_000]))
        want = _layout_by_definition(ps, slots, spans)
        got = _layout(ps, [f"r{i}" for i in range(k)], slots, spans, quiet=True)
        if want < 0:
            assert got is None
            continue
        assert got is not None and not got.ok
        assert got.positions[-1] == spans.pos()[want]
        offset_wrong = int(slots[want]) % ps != int(spans.pos()[want]) % ps
        assert ("sits at offset" in got.detail) == offset_wrong
