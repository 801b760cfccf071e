"""The ownership ledger on its own: transitions, the range and duplicate tests folded into them,
and the state left unchanged when a transition is refused."""

from __future__ import annotations

import numpy as np
import pytest

from memcli.mem_cache.integrity import OwnershipError
from memcli.mem_cache.integrity.ownership import FREE, LOOSE, OUTSIDE, PADDING, TREE, OwnershipLedger

NUM_PAGES = 512


def claimed(n: int, rows: list[int], page_size: int = 1) -> tuple[OwnershipLedger, np.ndarray]:
    """A ledger whose pages 1..n are owned by `rows` (equal shares, in order)."""
    ledger = OwnershipLedger(NUM_PAGES, page_size, num_rows=8)
    pages = np.arange(1, n + 1, dtype=np.int64)
    ledger.take(pages)
    ledger.claim_rows(pages * page_size, np.repeat(np.array(rows, dtype=np.int64), n // len(rows)), "test")
    return ledger, pages


def state(ledger: OwnershipLedger):
    return ledger.owner.copy(), ledger.row_pages.copy(), dict(ledger.counts)


def assert_same(ledger: OwnershipLedger, before) -> None:
    owner, row_pages, counts = before
    assert np.array_equal(ledger.owner, owner) and np.array_equal(ledger.row_pages, row_pages)
    assert ledger.counts == counts


def test_a_page_lives_free_row_tree_free():
    ledger, pages = claimed(40, [2, 5])
    assert ledger.counts[LOOSE] == 0 and ledger.row_pages[2] == ledger.row_pages[5] == 20
    ledger.move(pages[:20], 2, TREE, "cache_unfinished_req")
    ledger.free_from(pages[20:], 5, "cache_finished_req")
    assert ledger.counts[TREE] == 20 and not ledger.row_pages.any()
    ledger.free_from(pages[:20], TREE, "evict")
    assert ledger.counts == {FREE: NUM_PAGES, LOOSE: 0, TREE: 0, -4: 0, -6: 0}
    assert (ledger.owner[1:] == FREE).all() and ledger.owner[0] == PADDING


def test_owners_outside_the_pool_read_padding_or_outside():
    ledger = OwnershipLedger(NUM_PAGES, 1, num_rows=8)
    found = ledger.owners_of(np.array([-7, 0, 3, NUM_PAGES, NUM_PAGES + 1, 10**12]))
    assert found.tolist() == [PADDING, PADDING, FREE, FREE, OUTSIDE, OUTSIDE]


@pytest.mark.parametrize("n", [6, 30, 200])  # a set below 49 pages, the owner marks above
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_page_given_twice_in_one_call_is_refused_and_nothing_changes(n, where):
    ledger, pages = claimed(n, [3])
    before = state(ledger)
    dup = 0 if where == "first" else n - 1
    twice = np.concatenate([pages[: n // 2], pages[dup : dup + 1], pages[n // 2 :]])
    with pytest.raises(OwnershipError) as info:
        ledger.move(twice, 3, TREE, "cache_finished_req")
    assert info.value.check == "double_free" and f"slot {int(pages[dup])} given twice" in str(info.value)
    assert_same(ledger, before)
    with pytest.raises(OwnershipError, match="given twice"):
        ledger.free_from(twice, 3, "cache_finished_req")
    assert_same(ledger, before)
    with pytest.raises(OwnershipError, match="given twice"):  # one row per page
        ledger.free_from(twice, np.full(len(twice), 3, dtype=np.int64), "free_row_pages")
    assert_same(ledger, before)


@pytest.mark.parametrize("bad", [-1, NUM_PAGES + 1, 10**9])
@pytest.mark.parametrize("n", [4, 100])
def test_a_page_outside_the_pool_is_refused_as_slot_range(bad, n):
    ledger, pages = claimed(n, [1])
    before = state(ledger)
    with pytest.raises(OwnershipError) as info:
        ledger.move(np.append(pages, bad), 1, TREE, "cache_finished_req")
    assert info.value.check == "slot_range" and f"page {bad} is outside the pool" in str(info.value)
    assert_same(ledger, before)
    with pytest.raises(OwnershipError, match="outside the pool"):
        ledger.free_from(np.append(pages, bad), np.ones(n + 1, dtype=np.int64), "free_row_pages")
    assert_same(ledger, before)


def test_a_range_error_comes_before_a_duplicate_and_a_duplicate_before_an_owner():
    ledger, pages = claimed(100, [1])
    ledger.move(pages[50:], 1, TREE, "cache_unfinished_req")  # pages 51.. now the tree's
    mixed = np.concatenate([pages[:10], pages[60:61], pages[:1], [NUM_PAGES + 3]])
    with pytest.raises(OwnershipError, match="slot_range"):
        ledger.move(mixed, 1, TREE, "test")
    with pytest.raises(OwnershipError, match="given twice"):
        ledger.move(mixed[:-1], 1, TREE, "test")
    with pytest.raises(OwnershipError) as info:
        ledger.move(mixed[:-2], 1, TREE, "test")
    assert info.value.check == "owned_twice" and f"slot {int(pages[60])} is owned by the tree" in str(info.value)


def test_page_zero_is_padding_not_out_of_range():
    ledger, pages = claimed(4, [0])
    with pytest.raises(OwnershipError) as info:
        ledger.free_from(np.array([0]), LOOSE, "allocator.free")
    assert info.value.check == "double_free" and "owned by padding" in str(info.value)


@pytest.mark.parametrize("num_reqs", [3, 12])  # one slice per request, or one array of rows
def test_a_fused_claim_by_runs_equals_the_claim_by_slot(num_reqs):
    rng = np.random.default_rng(num_reqs)
    lens = rng.integers(0, 9, num_reqs)
    rows = rng.permutation(8)[:num_reqs] if num_reqs <= 8 else rng.integers(0, 8, num_reqs)  # rows repeat above 8
    pages = rng.permutation(np.arange(1, NUM_PAGES + 1))[: int(lens.sum())]
    by_runs, by_slot = (OwnershipLedger(NUM_PAGES, 1, num_rows=8) for _ in range(2))
    for ledger in (by_runs, by_slot):
        ledger.hand_out(pages)
    by_runs.claim_rows(pages, rows, "alloc_for_extend", lens=lens)
    by_slot.claim_rows(pages, np.repeat(rows, lens), "alloc_for_extend")
    assert_same(by_runs, state(by_slot))
    assert by_runs.counts[FREE] == NUM_PAGES - len(pages) and by_runs.counts[LOOSE] == 0
    assert int(by_runs.row_pages.sum()) == len(pages)


def test_a_claim_of_a_page_not_handed_out_is_refused():
    """A kernel that writes a page it was not given: the hand-out is settled, the claim judged alone."""
    ledger = OwnershipLedger(NUM_PAGES, 1, num_rows=8)
    ledger.hand_out(np.arange(1, 5))
    with pytest.raises(OwnershipError) as info:
        ledger.claim_rows(np.array([1, 2, 3, 9]), np.array([0]), "alloc_for_extend", lens=np.array([4]))
    assert "slot 9 is owned by free" in str(info.value)
    assert ledger.counts[LOOSE] == 4 and not ledger.row_pages.any()


@pytest.mark.parametrize("page,check", [(3, "owned_twice"), (0, "owned_twice"), (-2, "slot_range"),
                                        (NUM_PAGES + 1, "slot_range")])
def test_one_page_takes_the_same_tests(page, check):
    ledger, pages = claimed(4, [1])
    ledger.move(pages[2:3], 1, TREE, "cache_unfinished_req")  # page 3 now the tree's
    before = state(ledger)
    with pytest.raises(OwnershipError) as info:
        ledger.move(np.array([page]), 1, TREE, "decode slot in flight")
    assert info.value.check == check
    assert_same(ledger, before)
    ledger.move(np.array([2]), 1, TREE, "decode slot in flight")
    assert ledger.owner[2] == TREE and ledger.row_pages[1] == 2 and ledger.counts[TREE] == 2


def test_duplicates_in_calls_longer_than_the_marks_and_than_the_pool():
    ledger = OwnershipLedger(6000, 1, num_rows=2)
    pages = np.arange(1, 6001, dtype=np.int64)
    ledger.take(pages)
    ledger.claim_rows(pages, np.zeros(6000, dtype=np.int64), "test")
    before = state(ledger)
    for twice in (np.concatenate([pages[:5000], pages[4321:4322]]),  # past the first marks: they grow
                  np.concatenate([pages, pages[17:18]])):  # more positions than pages
        with pytest.raises(OwnershipError, match=f"slot {int(twice[-1])} given twice"):
            ledger.move(twice, 0, TREE, "cache_finished_req")
        assert_same(ledger, before)
    ledger.move(pages[:5000], 0, TREE, "cache_finished_req")
    assert ledger.counts[TREE] == 5000 and ledger.row_pages[0] == 1000


def test_the_history_tells_a_pages_life_with_steps_requests_and_reasons():
    ledger = OwnershipLedger(NUM_PAGES, 4, num_rows=8)
    ledger.name_rows([2, 5], ["a", "b"])
    ledger.step = 3
    ledger.take([7, 8])
    ledger.claim_rows(np.array([28, 32]), np.array([2, 5]), "alloc_for_extend")
    ledger.step = 4
    ledger.move(np.array([28]), 2, TREE, "cache_unfinished_req")
    ledger.acting = ("b", "retracted")
    ledger.free_from([8], 5, "cache_finished_req")
    ledger.acting = None
    ledger.step = 9
    ledger.free_from([7], TREE, "evict")
    with pytest.raises(OwnershipError) as info:
        ledger.free_from([7], TREE, "evict")
    story = [(t.page, t.step, t.rid, t.what, t.src, t.dst) for t in info.value.history]
    assert story == [
        (7, 3, None, "handed out by the allocator", "free", "nobody (allocated, unclaimed)"),
        (7, 3, "a", "allocated for an extend", "nobody (allocated, unclaimed)", "request row 2"),
        (7, 4, "a", "inserted into the tree", "request row 2", "the tree"),
        (7, 9, None, "evicted from the tree", "the tree", "free"),
        (7, 9, None, "double free", "free", "refused"),
    ]
    page_8 = ledger.history_of([8])
    assert [(t.step, t.rid, t.what) for t in page_8][-1] == (4, "b", "freed by a retraction")
    assert "history of page 7 (slots 28..31):" in str(info.value)


def test_the_history_keeps_its_newest_pages_within_its_bound():
    from memcli.mem_cache.integrity.history import PageHistory

    history = PageHistory(1, max_pages=10)
    for step in range(8):
        history.record(step, "evict", None, [1, 2, 3], TREE, FREE, -1)
    assert history.since_step == 5  # three entries of three pages fit
    assert [t.step for t in history.of_pages([2])] == [5, 6, 7]


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("seed", range(6))
def test_a_move_of_row_slots_judges_as_the_sorted_distinct_pages_do(page_size, seed):
    """`move` and `release` of a row's slots make the transition on the pages as the row holds
    them when they are distinct and the owner's, and otherwise judge exactly as the transition
    of `pages_of` (sorted, distinct) does: the same state after, the same error, the same
    stories of the pages."""
    rng = np.random.default_rng(seed)
    for _ in range(30):
        ledgers = []
        for _ in range(2):
            ledger = OwnershipLedger(NUM_PAGES, page_size, num_rows=8)
            pages = np.arange(1, 97, dtype=np.int64)
            ledger.take(pages)
            ledger.claim_rows(pages * page_size, np.repeat(np.array([1, 2, 3], dtype=np.int64), 32), "test")
            ledgers.append(ledger)
        own = rng.permutation(np.arange(33, 65))[: int(rng.integers(1, 20))]  # row 2's pages, in any order
        slots = (own[:, None] * page_size + np.arange(page_size)).reshape(-1)
        slots = slots[int(rng.integers(0, page_size)):]  # a row may start inside a page
        fault = rng.integers(0, 5)
        if fault == 1:  # a page of another row
            slots = np.append(slots, int(rng.integers(1, 33)) * page_size)
        elif fault == 2:  # a page seen twice, apart
            slots = np.append(slots, slots[0])
        elif fault == 3:  # a slot past the pool
            slots = np.append(slots, (NUM_PAGES + 3) * page_size)
        verb = "move" if rng.random() < 0.5 else "release"
        outcomes = []
        for ledger, judged_sorted in zip(ledgers, (False, True)):
            try:
                if judged_sorted:
                    dst = TREE if verb == "move" else LOOSE
                    ledger._transition(ledger.pages_of(slots), 2, dst, "test")
                elif verb == "move":
                    ledger.move(slots, 2, TREE, "test")
                else:
                    ledger.release(slots, 2, "test")
                outcomes.append(None)
            except OwnershipError as err:
                outcomes.append((err.message, err.story))
        assert outcomes[0] == outcomes[1]
        a, b = state(ledgers[0]), state(ledgers[1])
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
        probe = sorted({int(p) for p in np.asarray(slots) // page_size if 0 < p <= NUM_PAGES})[:4]
        assert [t for t in ledgers[0].history_of(probe)] == [t for t in ledgers[1].history_of(probe)]
