"""`run_checks`: the per-step page-level checks on a small running stack, clean and with planted faults.

Each fault is planted through the public objects (allocator, req_to_token, request pool) and
must be caught by the check that owns that invariant, naming the request, positions and slots.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.sched.helpers import scheduler_for
from memcli.config import load_config
from memcli.mem_cache.integrity import CHECK_NAMES, failures, run_checks
from memcli.sched.scheduler import Scheduler
from memcli.stack import build_stack

SHARED = np.arange(1, 23)  # 22 tokens: the shared prefix ends mid-page at page sizes 4 and 16


def running(page_size: int = 4, cache: str = "radix", steps: int = 4):
    """Three requests over one shared prefix, stepped until they all decode."""
    cfg = load_config(None, [
        f"memory.page_size={page_size}", "memory.max_total_tokens=256", "memory.max_running_requests=8",
        "memory.max_context_len=128", f"cache.kind={cache}", "runtime.device=cpu",
        "scheduler.chunked_prefill_size=null",
    ])
    stack = build_stack(cfg)
    sched = scheduler_for(stack, cfg, page_size=stack.scheduler_page_size)
    for i in range(3):
        own = np.arange(100 * (i + 1), 100 * (i + 1) + 5 + i)
        sched.add_request(sched.new_req(f"r{i}", np.concatenate([SHARED, own]), 12))
    for _ in range(steps):
        sched.step()
    return stack, sched


def found(stack, reqs):
    return failures(run_checks(stack, reqs))


def row_of(stack, req) -> torch.Tensor:
    return stack.req_to_token_pool.req_to_token[req.req_pool_idx]


def own_position(req, page_size: int, offset: int) -> int:
    """The first position of the request's own part at `offset` within its page."""
    for pos in range(req.last_matched_prefix_len, req.kv_allocated_len):
        if pos % page_size == offset:
            return pos
    raise AssertionError(f"{req} has no own position at offset {offset}")


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("cache", ["radix", "chunk"])
def test_clean_run_passes_every_check_at_every_step(page_size, cache):
    stack, sched = running(page_size, cache, steps=0)
    seen_running = False
    while not sched.is_done():
        sched.step()
        results = run_checks(stack, sched.memory_holders())
        assert [r.name for r in results] == list(CHECK_NAMES)
        assert failures(results) == [], [str(r) for r in results]
        seen_running |= bool(sched.active_reqs())
    assert seen_running
    idle = {r.name: r for r in run_checks(stack, [])}
    assert idle["idle"].ok and "available" in idle["idle"].detail


def test_page_freed_while_held_is_caught_by_free_list_and_conservation():
    stack, sched = running()
    req = sched.active_reqs()[0]
    slot = int(row_of(stack, req)[req.kv_allocated_len - 1])
    stack.allocator.free(torch.tensor([slot]))
    violations = found(stack, sched.memory_holders())
    names = [v.name for v in violations]
    assert names[0] == "free_list" and "conservation" in names
    first = violations[0]
    assert first.rid == req.rid and req.kv_allocated_len - 1 in range(first.positions[0], first.positions[1] + 1)
    assert f"page {slot // 4}" in first.detail
    conservation = next(v for v in violations if v.name == "conservation")
    assert "= 260 vs size 256" in conservation.detail  # one page counted twice: free and held


def test_page_freed_twice_shows_as_a_duplicate_in_the_free_list():
    stack, sched = running()
    req = sched.active_reqs()[0]
    slot = torch.tensor([int(row_of(stack, req)[req.kv_allocated_len - 1])])
    stack.allocator.free(slot)
    stack.allocator.free(slot)
    first = found(stack, sched.memory_holders())[0]
    assert first.name == "free_list"
    assert "2 times (freed twice)" in first.detail and first.slots == (int(slot) // 4 * 4,)


def test_page_freed_twice_at_page_size_1():
    stack, sched = running(page_size=1)
    req = sched.active_reqs()[0]
    slot = torch.tensor([int(row_of(stack, req)[req.kv_allocated_len - 1])])
    stack.allocator.free(slot)
    violations = found(stack, sched.memory_holders())
    assert [v.name for v in violations][:1] == ["free_list"]
    assert f"slot {int(slot)}" in violations[0].detail and violations[0].rid == req.rid


def test_slot_both_free_and_owned_with_counts_intact():
    """Point a request's last page at a free page: the counts still add up, the sets do not."""
    stack, sched = running()
    req = sched.active_reqs()[0]
    row, ps = row_of(stack, req), 4
    start = (req.kv_allocated_len - 1) // ps * ps
    free_page = int(stack.allocator.free_page_ids()[0])
    row[start:req.kv_allocated_len] = torch.arange(req.kv_allocated_len - start, dtype=row.dtype) + free_page * ps
    violations = found(stack, sched.memory_holders())
    names = [v.name for v in violations]
    assert names[0] == "free_list" and "no_lost_page" in names and "conservation" not in names
    assert violations[0].rid == req.rid and f"page {free_page}" in violations[0].detail


def test_misaligned_row_entry_is_caught_by_row_layout():
    stack, sched = running(page_size=16)
    req = sched.active_reqs()[1]
    pos = own_position(req, 16, offset=1)
    row = row_of(stack, req)
    row[pos] += 1
    first = found(stack, sched.memory_holders())[0]
    assert first.name == "row_layout" and first.rid == req.rid
    assert first.positions == (pos,) and first.slots == (int(row[pos]),)
    assert f"expected offset {pos % 16}" in first.detail


def test_non_consecutive_slots_on_one_page_are_caught():
    stack, sched = running(page_size=4)
    req = sched.active_reqs()[0]
    row = row_of(stack, req)
    pos = own_position(req, 4, offset=1)
    row[pos] += 4  # same offset, another page: offsets hold, the run breaks
    first = found(stack, sched.memory_holders())[0]
    assert first.name == "row_layout" and first.positions == (pos - 1, pos)


def test_page_shared_by_two_requests_outside_the_tree():
    stack, sched = running()
    a, b = sched.active_reqs()[:2]
    row_a, row_b = row_of(stack, a), row_of(stack, b)
    pos_b = own_position(b, 4, offset=0)
    page_a = int(row_a[own_position(a, 4, offset=0)]) // 4
    row_b[pos_b:pos_b + 4] = torch.arange(4, dtype=row_b.dtype) + page_a * 4
    first = found(stack, sched.memory_holders())[0]
    assert first.name == "page_sharing" and f"page {page_a}" in first.detail
    assert a.rid in first.detail and b.rid in first.detail


def test_prefix_pointing_outside_the_tree():
    stack, sched = running()
    req = next(r for r in sched.active_reqs() if r.last_matched_prefix_len >= 4)
    row = row_of(stack, req)
    own_start = own_position(req, 4, offset=0)
    row[0:4] = row[own_start:own_start + 4]
    names = [v.name for v in found(stack, sched.memory_holders())]
    assert names[0] == "page_sharing"


def test_slot_on_page_zero_is_out_of_range():
    stack, sched = running()
    req = sched.active_reqs()[0]
    row = row_of(stack, req)
    pos = own_position(req, 4, offset=0)
    row[pos:pos + 4] = torch.arange(4, dtype=row.dtype)
    first = found(stack, sched.memory_holders())[0]
    assert first.name == "slot_range" and first.positions == (pos,) and "page 0" in first.detail


def test_lost_page():
    stack, sched = running()
    stack.allocator.alloc(4)  # taken by nobody
    names = [v.name for v in found(stack, sched.memory_holders())]
    assert names == ["no_lost_page", "conservation"]


def test_cached_page_in_the_free_list():
    stack, sched = running(steps=0)
    sched.run()
    tree_slot = int(stack.tree_cache.all_values_flatten()[0])
    stack.allocator.free(torch.tensor([tree_slot]))
    violations = found(stack, [])
    assert violations[0].name == "free_list" and "the tree caches it" in violations[0].detail
    assert {"conservation", "tree", "idle"} <= {v.name for v in violations}


def test_idle_with_a_request_row_still_taken():
    stack, _ = running(steps=0)
    stack.req_to_token_pool.alloc(1)
    names = [v.name for v in found(stack, [])]
    assert "idle" in names and "1 request rows in use" in next(
        v.detail for v in found(stack, []) if v.name == "idle")
