"""check_integrity: each planted fault is caught by the check that names it, with numbers."""

import numpy as np
import pytest
import torch

from memcli.errors import IntegrityError
from memcli.mem_cache import tree_checks
from memcli.mem_cache.base_prefix_cache import RadixKey
from memcli.mem_cache.radix_cache import RadixCache
from tests.mem_cache.fakes import FakeAllocator


def build(page_size=1):
    """Tree [1,2] -> {[3,4], [5,6]} plus [7,8], slots from a fake allocator (all paged)."""
    allocator = FakeAllocator(64, page_size)
    cache = RadixCache(None, allocator, page_size)
    for tokens in ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8]):
        slots = allocator.alloc(len(tokens))
        prefix_len = cache.insert(RadixKey(tokens), slots)
        if prefix_len:
            allocator.free(slots[:prefix_len])
    report = cache.check_integrity()
    assert report.ok, str(report)
    return cache


def leaf(cache, *tokens):
    return cache.match_prefix(RadixKey(list(tokens))).last_node


def failed(cache):
    return {check.name for check in cache.check_integrity().failures}


@pytest.mark.parametrize("page_size", [1, 2])
def test_a_clean_tree_passes_every_check(page_size):
    report = build(page_size).check_integrity()
    expected = {"total_size", "evictable_plus_protected", "evictable_size", "protected_size", "node_count",
                "lock_refs", "key_value_lengths", "child_keys", "unique_slots", "slots_not_free", "eviction_queue"}
    if page_size > 1:
        expected.add("page_layout")
    assert {check.name for check in report.checks} == expected
    assert report.ok and report.failures == []
    report.raise_if_failed()


@pytest.mark.parametrize("page_size", [1, 2])
def test_double_owned_slot(page_size):
    cache = build(page_size)
    a, b = leaf(cache, 1, 2, 3, 4), leaf(cache, 7, 8)
    cache.allocator.free(b.value)  # keep the free list honest: only ownership is wrong
    cache.allocator.claim(b.value)
    b.value = a.value.clone()
    assert failed(cache) == {"unique_slots"}
    detail = cache.check_integrity().check("unique_slots").detail
    assert detail.startswith("2 of 8 slots owned by two nodes")
    if page_size > 1:
        assert "; 1 pages owned by two nodes" in detail


def test_counter_drift():
    cache = build()
    cache._evictable += 5
    assert failed(cache) == {"evictable_plus_protected", "evictable_size"}
    report = cache.check_integrity()
    assert report.check("evictable_plus_protected").detail == "evictable 13 + protected 0 != total 8"
    assert report.check("evictable_size").detail == "unlocked nodes hold 8 tokens, evictable counter 13"
    with pytest.raises(IntegrityError, match="evictable 13 \\+ protected 0 != total 8"):
        report.raise_if_failed()


def test_total_counter_drift():
    cache = build()
    cache._total -= 2
    assert failed(cache) == {"total_size", "evictable_plus_protected"}


@pytest.mark.parametrize("page_size", [1, 2])
def test_slot_both_free_and_owned(page_size):
    cache = build(page_size)
    cache.allocator.free(leaf(cache, 7, 8).value)  # freed behind the tree's back
    assert failed(cache) == {"slots_not_free"}
    detail = cache.check_integrity().check("slots_not_free").detail
    assert detail.startswith("2 of 8 tree slots are also in the allocator's")


def test_negative_lock_ref():
    cache = build()
    leaf(cache, 7, 8).lock_ref = -1
    assert "lock_refs" in failed(cache)


def test_parent_locked_less_than_children():
    cache = build()
    node = leaf(cache, 1, 2, 3, 4)
    cache.inc_lock_ref(node)
    node.parent.lock_ref = 0
    cache._evictable += 2
    cache._protected -= 2
    assert failed(cache) == {"lock_refs"}


def test_child_registered_under_the_wrong_key():
    cache = build()
    root = cache.root
    root.children[99] = root.children.pop(7)
    assert failed(cache) == {"child_keys"}


def test_key_value_length_mismatch():
    cache = build()
    node = leaf(cache, 7, 8)
    node.value = node.value[:1]
    assert "key_value_lengths" in failed(cache)


def test_unaligned_node_in_a_paged_tree():
    cache = build(2)
    node = leaf(cache, 7, 8)
    node.key, node.value = node.key[:1], node.value[:1]
    cache._total -= 1
    cache._evictable -= 1
    assert "key_value_lengths" in failed(cache)


def test_evictable_leaf_missing_from_the_queue():
    cache = build()
    leaf(cache, 7, 8).heap_seq = -5
    assert failed(cache) == {"eviction_queue"}


@pytest.mark.parametrize("page_size", [1, 2])
def test_an_empty_tree_names_the_free_slots_without_gathering_them(page_size):
    """The idle walk before the first request: no tree slot can be free, and the detail gives
    the free slots (the allocator's count, the length of the list a gather would build)."""
    allocator = FakeAllocator(64, page_size)
    cache = RadixCache(None, allocator, page_size)
    allocator.alloc(2 * page_size)
    check = cache.check_integrity().check("slots_not_free")
    assert check.ok and len(allocator.free_slot_ids()) == allocator.available_size()
    assert check.detail == f"0 of 0 tree slots are also in the allocator's {allocator.available_size()} free slots"


# -- the marks behind unique_slots and slots_not_free (CPU) --------------------------------------

def _bincount_duplicates(ids):
    return torch.nonzero(torch.bincount(ids) > 1).flatten()


@pytest.mark.parametrize("seed", range(6))
def test_duplicates_by_marks_are_bincounts(seed):
    """The marks' answer (no id twice) and the bincount's list agree, with and without repeats."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(5000, generator=gen)[:1200] + 1
    if seed % 2:
        ids[torch.randint(600, 1200, (seed,), generator=gen)] = ids[:seed].clone()  # a few ids given twice
    got = tree_checks._duplicates(ids, tree_checks._slot_marks(ids))
    assert got.tolist() == _bincount_duplicates(ids).tolist()
    assert (len(got) > 0) == bool(seed % 2)


def test_duplicates_of_a_negative_id_go_to_the_tensor_path():
    ids = torch.tensor([3, -1, 5])
    assert tree_checks._slot_marks(ids) is None
    with pytest.raises(RuntimeError):
        tree_checks._duplicates(ids, tree_checks._slot_marks(ids))


def test_any_marked_ignores_ids_outside_the_marks():
    marks = tree_checks._slot_marks(torch.tensor([2, 5, 9]))
    assert len(marks) == 10
    assert not tree_checks._any_marked(marks, np.array([1, 3, 10, 400, -2, -9]))
    assert tree_checks._any_marked(marks, np.array([400, -1, 9]))  # -1 would read the last flag unmasked
    assert not tree_checks._any_marked(marks, np.array([-1]))


def test_free_slot_found_past_the_marks_fast_path():
    """A free slot among the tree's: found whether the free list reaches past the tree's largest
    slot or not, and the detail lists it in tree order."""
    values = torch.tensor([7, 3, 11, 4])
    marks = tree_checks._slot_marks(values)

    class Free:
        def __init__(self, ids):
            self.ids = torch.tensor(ids)

        def free_slot_ids(self):
            return self.ids

    clean = tree_checks._free_slot_check(Free([1, 2, 12, 40]), values, marks)
    assert clean.ok and clean.detail == "0 of 4 tree slots are also in the allocator's 4 free slots"
    dirty = tree_checks._free_slot_check(Free([40, 4, 11, 1]), values, marks)
    assert not dirty.ok
    assert dirty.detail == "2 of 4 tree slots are also in the allocator's 4 free slots, e.g. [11, 4]"
    assert dirty == tree_checks._free_slot_check(Free([40, 4, 11, 1]), values)  # the tensor path's own answer
