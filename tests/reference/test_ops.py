"""memcli's RadixCache + allocator against SGLang's, operation by operation.

Under the `sglang-0.5.5` profile every operation must agree: results, tree shape, free
list, sizes and eviction order. Under the `memcli` profile the documented differences
(docs/FIDELITY.md: split stamps, LFU hit counts) must show, so each key is seen to matter.
"""

import pytest

from memcli.config import SemanticsConfig
from memcli.reference.ops import OBSERVED, Op, generate_ops, run_ops, shrink

SGLANG, MEMCLI = "sglang-0.5.5", "memcli"
BEHAVIOUR = ("result", "tree", "free_list", "sizes")


def insert(*tokens):
    return Op("insert", tuple(tokens))


def match(*tokens):
    return Op("match", tuple(tokens))


def evict(num_tokens):
    return Op("evict", num_tokens)


def _assert_same(ops, page_size, policy, fields=OBSERVED, profile=SGLANG):
    divergence = run_ops(ops, page_size, policy, fields=fields, profile=profile)
    assert divergence is None, str(divergence)


def _assert_differs(ops, page_size, policy, fields=BEHAVIOUR, profile=MEMCLI):
    assert run_ops(ops, page_size, policy, fields=fields, profile=profile) is not None


def test_plain_inserts_matches_locks_and_evictions_agree(ref):
    ops = [insert(1, 2, 3), insert(4, 5), match(1, 2, 3, 9), Op("lock", 2), evict(8),
           Op("unlock", 2), insert(4, 5, 6), evict(2), evict(10)]
    _assert_same(ops, 1, "lru")
    _assert_same(ops, 1, "lru", fields=BEHAVIOUR, profile=MEMCLI)


def test_paged_free_list_order_agrees(ref):
    ps = 16
    # The match ends mid-page inside [2] * 16: floored to the node boundary, so nothing splits.
    ops = [insert(*[1] * ps), insert(*[1] * ps, *[2] * ps), insert(*[3] * ps), match(*[1] * ps, *[2] * (ps - 1), 9),
           Op("lock", 3), evict(3 * ps), Op("unlock", 3), evict(3 * ps)]
    _assert_same(ops, ps, "lru")


def test_new_leaf_is_newer_than_the_split_tail(ref):
    """SGLang stamps each node with its own clock read (tail, then the new upper node, then
    the new leaf): one shared time per operation would tie the tail and the leaf."""
    _assert_same([insert(1, 2, 3, 4), insert(1, 2, 5, 6), evict(2)], 1, "lru")


@pytest.mark.parametrize("page_size", [1, 16])
def test_split_by_match_refreshes_the_tail(ref, page_size):
    def page(t):
        return (t,) * page_size
    # SGLang evicts [5] (the tail [3, 4] was refreshed by the match); the memcli profile
    # (split_stamp: keep) evicts the tail, whose last use is older.
    ops = [insert(*page(1), *page(2), *page(3), *page(4)), insert(*page(5), *page(6)), match(*page(1), *page(2)),
           evict(2 * page_size)]
    _assert_same(ops, page_size, "lru")
    _assert_differs(ops, page_size, "lru")


def test_split_by_insert_refreshes_the_tail(ref):
    ops = [insert(1, 2, 3, 4), insert(5, 6), insert(1, 2, 7, 8), evict(2)]
    _assert_same(ops, 1, "lru")
    _assert_differs(ops, 1, "lru")


def test_lfu_ignores_hits(ref):
    # SGLang (LFU == LRU) evicts [1, 2], the older leaf; counting hits evicts [3, 4].
    ops = [insert(1, 2), match(1, 2), insert(3, 4), evict(2)]
    _assert_same(ops, 1, "lfu")
    _assert_differs(ops, 1, "lfu")
    # The one key alone makes the difference: the memcli profile with hits never counted agrees.
    _assert_same(ops, 1, "lfu", fields=BEHAVIOUR, profile=SemanticsConfig(profile=MEMCLI, lfu_hits="never"))


RANDOM_CASES = [(seed, ps, policy) for seed in (1, 2, 3, 4) for ps in (1, 4, 16) for policy in ("lru", "lfu", "fifo")]


@pytest.mark.parametrize("seed,page_size,policy", RANDOM_CASES)
def test_random_operation_sequences(ref, seed, page_size, policy):
    _assert_same(generate_ops(seed, page_size, 80), page_size, policy)


def test_the_memcli_profile_diverges_on_random_sequences(ref):
    found = [run_ops(generate_ops(seed, 1, 80), 1, "lru", fields=BEHAVIOUR, profile=MEMCLI) for seed in (1, 2, 3, 4)]
    assert any(f is not None for f in found)


def test_shrink_finds_a_minimal_repro(ref):
    ops = generate_ops(2, 1, 60)
    small = shrink(ops, 1, "lru", profile=MEMCLI)
    assert len(small) <= 4 and run_ops(small, 1, "lru", profile=MEMCLI) is not None
