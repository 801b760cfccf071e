"""memcli's RadixCache + allocator against SGLang's, operation by operation.

Cases where memcli diverges today are strict xfails named after the divergence, so they
flip (XPASS fails the run) once memcli's `sglang-0.5.5` profile reproduces the reference;
the harness's memcli side will then need to build that profile.
"""

import pytest

from memcli.reference.ops import OBSERVED, Op, generate_ops, run_ops, shrink

SPLIT_STAMP = ("split stamps: SGLang refreshes a node's access time before splitting it, so the split-off tail"
               " is recent; memcli's tail keeps its old time")
LFU_HITS = ("LFU hit counting: SGLang's RadixCache never increments hit_count (LFU degenerates to LRU);"
            " memcli counts a hit per node on every match")


def insert(*tokens):
    return Op("insert", tuple(tokens))


def match(*tokens):
    return Op("match", tuple(tokens))


def evict(num_tokens):
    return Op("evict", num_tokens)


def _assert_same(ops, page_size, policy, fields=OBSERVED):
    divergence = run_ops(ops, page_size, policy, fields=fields)
    assert divergence is None, str(divergence)


def test_plain_inserts_matches_locks_and_evictions_agree(ref):
    ops = [insert(1, 2, 3), insert(4, 5), match(1, 2, 3, 9), Op("lock", 2), evict(8),
           Op("unlock", 2), insert(4, 5, 6), evict(2), evict(10)]
    _assert_same(ops, 1, "lru")


def test_paged_free_list_order_agrees(ref):
    ps = 16
    # The match ends mid-page inside [2] * 16: floored to the node boundary, so nothing splits.
    ops = [insert(*[1] * ps), insert(*[1] * ps, *[2] * ps), insert(*[3] * ps), match(*[1] * ps, *[2] * (ps - 1), 9),
           Op("lock", 3), evict(3 * ps), Op("unlock", 3), evict(3 * ps)]
    _assert_same(ops, ps, "lru")


def test_new_leaf_is_newer_than_the_split_tail(ref):
    """Agrees today only because memcli's tail keeps its old time; a fix of the split stamp
    that gives the tail and the new leaf one shared time would break it (SGLang stamps each
    node with its own clock read: tail, then upper node, then the new leaf)."""
    _assert_same([insert(1, 2, 3, 4), insert(1, 2, 5, 6), evict(2)], 1, "lru")


@pytest.mark.xfail(strict=True, reason=SPLIT_STAMP)
@pytest.mark.parametrize("page_size", [1, 16])
def test_split_by_match_refreshes_the_tail(ref, page_size):
    def page(t):
        return (t,) * page_size
    # SGLang evicts [5] (the tail [3, 4] was refreshed by the match); memcli evicts the tail.
    ops = [insert(*page(1), *page(2), *page(3), *page(4)), insert(*page(5), *page(6)), match(*page(1), *page(2)),
           evict(2 * page_size)]
    _assert_same(ops, page_size, "lru", fields=("result", "tree", "free_list", "sizes"))


@pytest.mark.xfail(strict=True, reason=SPLIT_STAMP)
def test_split_by_insert_refreshes_the_tail(ref):
    _assert_same([insert(1, 2, 3, 4), insert(5, 6), insert(1, 2, 7, 8), evict(2)], 1, "lru",
                 fields=("result", "tree", "free_list", "sizes"))


@pytest.mark.xfail(strict=True, reason=LFU_HITS)
def test_lfu_ignores_hits(ref):
    # SGLang (LFU == LRU) evicts [1, 2], the older leaf; memcli evicts [3, 4], which has no hit.
    _assert_same([insert(1, 2), match(1, 2), insert(3, 4), evict(2)], 1, "lfu",
                 fields=("result", "tree", "free_list", "sizes"))


# Random sequences of 60 operations (seeds 1 and 2, not picked). All but one diverge today
# through the divergences named (checked); seed 1 at page size 16 with LRU agrees.
AGREE_TODAY = {(1, 16, "lru")}


def _random_case(seed, ps, policy):
    if (seed, ps, policy) in AGREE_TODAY:
        return pytest.param(seed, ps, policy)
    reason = SPLIT_STAMP if policy == "lru" else f"{SPLIT_STAMP}; {LFU_HITS}"
    return pytest.param(seed, ps, policy, marks=pytest.mark.xfail(strict=True, reason=reason))


RANDOM_CASES = [_random_case(seed, ps, policy) for seed in (1, 2) for ps in (1, 4, 16) for policy in ("lru", "lfu")]


@pytest.mark.parametrize("seed,page_size,policy", RANDOM_CASES)
def test_random_operation_sequences(ref, seed, page_size, policy):
    _assert_same(generate_ops(seed, page_size, 60), page_size, policy)


def test_shrink_finds_a_minimal_repro(ref):
    ops = generate_ops(2, 1, 60)
    small = shrink(ops, 1, "lru")
    assert len(small) <= 4 and run_ops(small, 1, "lru") is not None
