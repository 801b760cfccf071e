"""The memory manager's verbs: exact slots, eviction of the shortfall, OOM, the records it writes."""

import pytest
import torch

from memcli.errors import OutOfMemoryError, RequestSlotsExhausted
from memcli.mem_cache import pages
from memcli.mem_cache.manager import ExtendAllocation, ExtendPlan, PageSizeMismatch, Release, Usage
from memcli.mem_cache.base_prefix_cache import RadixKey
from memcli.sched.batch import ScheduleBatch
from memcli.sched.req import Req
from tests.sched.helpers import small_stack as _small_stack, tokens


def small_stack(*args, **kw):
    """SGLang 0.5.5's stack: the slots, rows (from row 0) and evictions these tests expect are its."""
    kw.setdefault("semantics__engine", "sglang-0.5.5")
    return _small_stack(*args, **kw)


def make_reqs(stack, *token_arrays, max_new=4):
    reqs = [Req(str(i), t, max_new, stack.device) for i, t in enumerate(token_arrays)]
    for r in reqs:
        r.init_next_round_input(stack.memory)
    return reqs


def extend(stack, reqs):
    batch = ScheduleBatch(reqs, stack.memory)
    assert batch.prepare_for_extend()
    return batch


def require_extend(stack, reqs):
    """Serve the extend through `require_extend`, which raises where `alloc_extend` says None."""
    return stack.memory.require_extend(stack.memory.plan_extend(reqs))


def row(stack, req, n=None):
    n = req.kv_allocated_len if n is None else n
    return stack.req_to_token_pool.req_to_token[req.req_pool_idx, :n].tolist()


def test_extend_token_path_exact_slots():
    _, stack = small_stack(page_size=1, pool=64)
    a, b = make_reqs(stack, tokens((0, 3)), tokens((100, 2)))
    batch = extend(stack, [a, b])
    assert batch.out_cache_loc.tolist() == [1, 2, 3, 4, 5]
    assert (a.req_pool_idx, b.req_pool_idx) == (0, 1)
    assert row(stack, a) == [1, 2, 3] and row(stack, b) == [4, 5]
    assert batch.out_cache_loc.dtype == torch.int64


def test_extend_paged_continues_the_prefix_partial_page():
    _, stack = small_stack(page_size=4, pool=64)
    (a,) = make_reqs(stack, tokens((0, 6)))
    extend(stack, [a])
    assert row(stack, a) == [4, 5, 6, 7, 8, 9]  # pages 1 and 2, position t at offset t % 4
    # A second round of the same request continues after its own slots (chunk-style prefix).
    a.kv.prefix_indices = torch.tensor(row(stack, a), dtype=torch.int64)
    a.fill_ids = tokens((0, 9))
    a.extend_input_len = 3
    batch = extend(stack, [a])
    assert batch.out_cache_loc.tolist() == [10, 11, 12]  # fills page 2, then opens page 3
    assert row(stack, a) == [4, 5, 6, 7, 8, 9, 10, 11, 12]


def test_last_loc_comes_from_prefix_indices_not_req_to_token():
    _, stack = small_stack(page_size=4, pool=64)
    (a,) = make_reqs(stack, tokens((0, 2)))
    a.kv.prefix_indices = torch.tensor([40], dtype=torch.int64)  # page 10, never written to req_to_token
    a.fill_ids = tokens((0, 6))
    a.extend_input_len = 5
    batch = extend(stack, [a])
    assert batch.out_cache_loc.tolist() == [41, 42, 43, 4, 5]
    assert row(stack, a) == [40, 41, 42, 43, 4, 5]


def test_decode_writes_at_old_seq_len_then_caller_increments():
    _, stack = small_stack(page_size=4, pool=64)
    a, b = make_reqs(stack, tokens((0, 4)), tokens((50, 3)))
    batch = extend(stack, [a, b])
    assert row(stack, a) == [4, 5, 6, 7] and row(stack, b) == [8, 9, 10]
    batch.prepare_for_decode()
    # a's position 4 opens a new page (4 % 4 == 0); b continues its page.
    assert batch.out_cache_loc.tolist() == [12, 11]
    assert batch.seq_lens.tolist() == [5, 4] and batch.seq_lens_cpu.tolist() == [5, 4]
    assert row(stack, a) == [4, 5, 6, 7, 12] and row(stack, b) == [8, 9, 10, 11]


@pytest.mark.parametrize("profile, asked_for, left", [("memcli", 3, 6), ("sglang-0.5.5", 7, 0)])
def test_eviction_asks_for_the_shortfall_or_the_whole_need(profile, asked_for, left):
    """need 7, available 4: the memcli profile evicts the shortfall of 3 (one leaf of 6 goes),
    SGLang's `evict_from_tree_cache` the whole need of 7 (both leaves go)."""
    _, stack = small_stack(page_size=1, pool=16, semantics__profile=profile)
    tree = stack.tree_cache
    slots = stack.allocator.alloc(12)
    tree.insert(RadixKey(tokens((0, 6))), slots[:6])
    tree.insert(RadixKey(tokens((100, 6))), slots[6:])
    assert stack.allocator.available_size() == 4
    asked = []
    real_evict = tree.evict
    tree.evict = lambda n: asked.append(n) or real_evict(n)
    (a,) = make_reqs(stack, tokens((500, 7)))
    extend(stack, [a])
    assert asked == [asked_for]
    assert tree.evictable_size() == left


@pytest.mark.parametrize("profile, asked_for", [("memcli", 4), ("sglang-0.5.5", 4 + 2 * 4)])
def test_paged_extend_estimates_the_pages_exactly_or_one_per_request(profile, asked_for):
    """Two requests of 2 new tokens each at page size 4 open 2 pages (8 tokens): with 4 tokens
    free the memcli profile evicts the shortfall 4; SGLang evicts its estimate
    extend_num_tokens + bs * page_size = 4 + 8 = 12 in full."""
    _, stack = small_stack(page_size=4, pool=64, semantics__profile=profile)
    tree = stack.tree_cache
    for start in (0, 100, 200):
        tree.insert(RadixKey(tokens((start, 20))), stack.allocator.alloc(20))
    assert stack.allocator.available_size() == 4
    asked = []
    real_evict = tree.evict
    tree.evict = lambda n: asked.append(n) or real_evict(n)
    extend(stack, make_reqs(stack, tokens((500, 2)), tokens((600, 2))))
    assert asked == [asked_for]


def test_no_eviction_when_memory_suffices():
    _, stack = small_stack(page_size=4, pool=64)
    tree = stack.tree_cache
    tree.insert(RadixKey(tokens((0, 8))), stack.allocator.alloc(8))
    (a,) = make_reqs(stack, tokens((500, 5)))
    extend(stack, [a])
    assert tree.evictable_size() == 8


def test_oom_raises_with_numbers_and_returns_request_rows():
    _, stack = small_stack(page_size=4, pool=16)
    a, b = make_reqs(stack, tokens((0, 9)), tokens((100, 9)))
    rows_before = stack.req_to_token_pool.available_size()
    assert not ScheduleBatch([a, b], stack.memory).prepare_for_extend()
    with pytest.raises(OutOfMemoryError) as info:
        require_extend(stack, [a, b])
    assert "need 24 tokens, available 16 + evictable 0, protected 0" in str(info.value)
    assert stack.req_to_token_pool.available_size() == rows_before
    assert stack.allocator.available_size() == 16
    assert a.req_pool_idx is None


def test_request_rows_exhausted_is_typed():
    _, stack = small_stack(page_size=1, pool=64, rows=1)
    reqs = make_reqs(stack, tokens((0, 2)), tokens((10, 2)))
    assert stack.memory.alloc_extend(stack.memory.plan_extend(reqs)) is None
    with pytest.raises(RequestSlotsExhausted, match="max_running_requests"):
        require_extend(stack, reqs)


def test_page_size_mismatch_is_refused():
    from memcli.stack import build_stack
    from tests.sched.helpers import small_config

    stack = build_stack(small_config(page_size=16, pool=256), page_size_overrides={"tree_cache": 1})
    (a,) = make_reqs(stack, tokens((0, 5)))
    with pytest.raises(PageSizeMismatch, match="allocator 16, tree cache 1"):
        extend(stack, [a])


def test_extend_needs_exact_pages_not_a_page_per_request():
    _, stack = small_stack(page_size=4, pool=64)
    alloc = stack.allocator
    prefix = torch.tensor([0, 3, 4])
    seq = torch.tensor([4, 5, 8])
    assert pages.extend_new_pages(prefix, seq, alloc.page_size) * alloc.page_size == 4 * (1 + 1 + 1)
    assert pages.decode_new_pages(torch.tensor([4, 5, 8, 9]), alloc.page_size) * alloc.page_size == 8


def test_release_frees_exactly_what_was_allocated_once():
    _, stack = small_stack(page_size=4, pool=64, cache="chunk")
    (a,) = make_reqs(stack, tokens((0, 6)))
    batch = extend(stack, [a])
    batch.prepare_for_decode()
    a.kv.kv_committed_len = a.kv_allocated_len
    stack.memory.release(a, Release.FINISHED)
    assert stack.allocator.available_size() == 64
    assert stack.req_to_token_pool.available_size() == stack.req_to_token_pool.size
    with pytest.raises(Exception, match="already freed"):
        stack.memory.release(a)


@pytest.mark.parametrize("page_size", [1, 4])
def test_triton_and_torch_backends_allocate_the_same_slots(page_size):
    """The whole extend + decode path (host-computed offsets, kernels) on both backends."""
    results = []
    device = "cuda" if torch.cuda.is_available() else "cpu"  # triton on a CPU runs interpreted
    for backend in ("torch", "triton"):
        _, stack = small_stack(page_size=page_size, pool=256, runtime__kernel_backend=backend,
                               runtime__device=device)
        first = make_reqs(stack, tokens((0, 13)), tokens((100, 6)))
        extend(stack, first)
        for r in first:
            r.kv.kv_committed_len = r.kv_allocated_len
            stack.tree_cache.cache_unfinished_req(r)
        # Second batch: one request reuses a cached prefix, one has none, one is new.
        second = make_reqs(stack, tokens((0, 13), (500, 5)), tokens((900, 3)), tokens((100, 6), (700, 2)))
        batch = extend(stack, second)
        # The triton path copies the kernel's plan built with the batch's plan; torch builds none.
        assert (batch.extend_plan.host_plan is not None) == (backend == "triton")
        batch.prepare_for_decode()
        rows = [row(stack, r) for r in first + second]
        results.append((batch.out_cache_loc.tolist(), rows, stack.allocator.free_page_ids().tolist()))
    assert results[0] == results[1]


def test_extend_plan_is_immutable_and_counts_once():
    import dataclasses

    prefix = torch.tensor([8, 9, 10], dtype=torch.int64)
    plan = ExtendPlan.build([None, 3], [prefix, torch.empty(0, dtype=torch.int64)], [5, 6], page_size=4)
    assert plan.rows == [None, 3]
    assert plan.prefix_lens_cpu.tolist() == [3, 0] and plan.seq_lens_cpu.tolist() == [5, 6]
    assert plan.extend_lens_cpu.tolist() == [2, 6] and plan.extend_num_tokens == 8
    assert plan.num_pages == (2 - 1) + 2
    assert plan.prefix_tensors[0] is prefix
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_pages = 0


def test_alloc_extend_takes_a_plan_returns_an_allocation_and_writes_the_records():
    _, stack = small_stack(page_size=4, pool=64)
    (a,) = make_reqs(stack, tokens((0, 6)))
    plan = ExtendPlan.build([None], [a.prefix_indices], [6], page_size=4)
    got = stack.memory.alloc_extend(plan, [a])
    assert isinstance(got, ExtendAllocation)
    assert got.out_cache_loc.tolist() == [4, 5, 6, 7, 8, 9]
    assert got.rows == [0] and got.req_pool_indices.tolist() == [0] and got.seq_lens.tolist() == [6]
    assert a.req_pool_idx == 0 and a.kv_allocated_len == 6  # memory wrote the record
    assert stack.req_to_token_pool.req_to_token[0, :6].tolist() == [4, 5, 6, 7, 8, 9]


def test_alloc_decode_and_can_decode_take_the_page_count_from_the_caller():
    _, stack = small_stack(page_size=4, pool=12)
    memory = stack.memory
    (a,) = make_reqs(stack, tokens((0, 8)))
    batch = extend(stack, [a])  # pages 1 and 2 of 3; one page left
    tensors = dict(seq_lens=batch.seq_lens, seq_lens_cpu=batch.seq_lens_cpu, req_pool_indices=batch.req_pool_indices)
    assert memory.can_decode(num_pages=1)
    assert not memory.can_decode(num_pages=2)
    out, after = memory.alloc_decode([a], num_pages=1, **tensors)
    assert out.tolist() == [12] and stack.allocator.available_size() == 0
    assert after.tolist() == [9] and batch.seq_lens.tolist() == [8]  # the lengths after the step, a new tensor
    assert a.kv_allocated_len == 9
    assert memory.alloc_decode([a], num_pages=1, **tensors) is None  # no page left: nothing taken
    assert a.kv_allocated_len == 9


def test_usage_is_named():
    _, stack = small_stack(page_size=4, pool=64)
    u = stack.memory.usage()
    assert isinstance(u, Usage)
    assert (u.available, u.evictable, u.protected) == (64, 0, 0) == tuple(u)


def test_a_retracted_request_gives_back_everything_and_its_record_is_emptied():
    _, stack = small_stack(page_size=4, pool=64)
    (a,) = make_reqs(stack, tokens((0, 6)))
    extend(stack, [a])
    stack.memory.release(a, Release.RETRACTED)
    assert stack.allocator.available_size() + stack.tree_cache.evictable_size() == 64
    assert (a.req_pool_idx, a.kv_allocated_len, len(a.prefix_indices), a.kv_freed) == (None, 0, 0, False)


def test_nothing_above_memory_can_write_a_request_record():
    _, stack = small_stack(page_size=4, pool=64)
    (a,) = make_reqs(stack, tokens((0, 6)))
    for name in ("req_pool_idx", "prefix_indices", "kv_allocated_len", "kv_committed_len", "last_node"):
        with pytest.raises(AttributeError):
            setattr(a, name, None)
