"""memcli's HiRadixCache against SGLang 0.5.5's real HiRadixCache, operation by operation.

SGLang's side runs its real tree, allocator and host pool free list with a synchronous cache
controller (copies done at once, acknowledged by `check_hicache_events`). Under the
`sglang-0.5.5` profile every operation must agree: match results (device slots and host hit
length), load-backs, evictions (device frees, host frees), the tree with device and host
slots and lock counts, both free lists and the sizes.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memcli.reference.hiops import Op, block_pages, generate_hi_ops, ops_from_trace, run_hi_ops
from memcli.workload.readers import read_trace

POLICIES = ("write_through", "write_through_selective", "write_back")
FIELDS_NO_RESULT = ("tree", "free_list", "host_free_list", "sizes")


def _same(ops, page_size, policy="lru", write_policy="write_through", **kw):
    divergence = run_hi_ops(ops, page_size, policy, write_policy, **kw)
    assert divergence is None, str(divergence)


def _tokens(*blocks, n=12):
    return tuple(t for b in blocks for t in [b] * n)


def test_backup_evict_and_load_back_agree(ref):
    a, b = _tokens(1), _tokens(2)
    ops = [Op("insert", a + b), Op("events", None), Op("evict", 24), Op("match", a + b + (9,)),
           Op("load", 3), Op("events", None), Op("insert", _tokens(3)), Op("evict", 12), Op("evict", 100)]
    _same(ops, 1)


@pytest.mark.parametrize("write_policy", POLICIES)
def test_write_thresholds_and_chunked_inserts(ref, write_policy):
    a = _tokens(1, 2)
    # Hits come from inserts, not matches; a chunked insert counts none.
    ops = [Op("insert", a), Op("chunk", a), Op("match", a), Op("insert", a), Op("events", None), Op("evict", 24),
           Op("match", a + (5,))]
    _same(ops, 1, write_policy=write_policy)


def test_a_host_hit_under_the_threshold_is_not_loaded(ref):
    short = tuple(range(8))
    ops = [Op("insert", short), Op("events", None), Op("evict", 8), Op("match", short + (99,)), Op("load", 3)]
    _same(ops, 1)
    assert run_hi_ops(ops, 1, fields=("result",)) is None


def test_host_eviction_when_the_host_pool_is_full(ref):
    keys = [_tokens(i, n=16) for i in range(1, 8)]
    ops = []
    for key in keys:
        ops += [Op("insert", key), Op("events", None), Op("evict", 16)]
    ops += [Op("match", keys[0] + (0,)), Op("match", keys[-1] + (0,))]
    _same(ops, 1, size=32, ratio=1.5)


RANDOM = [(seed, ps, wp, policy) for seed in (1, 2) for ps in (1, 16) for wp in POLICIES for policy in ("lru", "lfu")]


@pytest.mark.parametrize("seed,page_size,write_policy,policy", RANDOM)
def test_random_operation_sequences(ref, seed, page_size, write_policy, policy):
    size = 12 * block_pages(page_size) * page_size
    _same(generate_hi_ops(seed, page_size, 150), page_size, policy, write_policy, size=size, ratio=1.5)


def _op_strategy(page_size: int):
    block = block_pages(page_size) * page_size
    tokens = st.lists(st.integers(0, 2), min_size=1, max_size=5).map(
        lambda blocks: tuple(t for b in blocks for t in [b] * block))
    handle = st.integers(0, 200)
    count = st.integers(1, 3).map(lambda n: n * block)
    return st.one_of(
        st.tuples(st.sampled_from(["insert", "insert", "chunk", "match", "match"]), tokens),
        st.tuples(st.sampled_from(["load", "load", "lock", "unlock"]), handle),
        st.tuples(st.sampled_from(["evict", "evict_host"]), count),
        st.just(("events", None)),
    )


def _resolve_handles(raw):
    """Handles drawn as numbers point at one of the matches before them."""
    ops, matches = [], []
    for kind, arg in raw:
        if kind in ("load", "lock", "unlock"):
            if not matches:
                continue
            arg = matches[arg % len(matches)]
        if kind == "match":
            matches.append(len(ops))
        ops.append(Op(kind, arg))
    return ops


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("write_policy", POLICIES)
def test_hypothesis_operation_sequences(ref, page_size, write_policy):
    size = 8 * block_pages(page_size) * page_size

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
    @given(st.lists(_op_strategy(page_size), min_size=1, max_size=60))
    def check(raw):
        _same(_resolve_handles(raw), page_size, "lru", write_policy, size=size, ratio=1.5)

    check()


CONVERSATION = "tests/data/conversation_head300.jsonl"


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_bundled_trace(ref, write_policy):
    """The conversation trace's 300 requests (cut to 1,024 tokens: its reuse comes 230 k to
    780 k tokens apart, so the host pool is 16 x the device pool) as a serving loop issues
    them. Not vacuous: memcli's side (which agrees with SGLang's) sees host hits, loads them
    back and evicts host copies."""
    import memcli.reference.hiops as hiops

    seen = {"host_hit": 0, "loaded": 0, "host_evicted": 0}
    real = hiops._apply

    def spy(side, index, op):
        result = real(side, index, op)
        if type(side.tree).__module__.startswith("memcli"):
            seen["host_hit"] += op.kind == "match" and result[3] > 0
            seen["loaded"] += op.kind == "load" and bool(result[1])
            seen["host_evicted"] = side.tree.host_evicted_tokens
        return result

    trace = read_trace(CONVERSATION)
    ops = ops_from_trace([spec.input_ids() for spec in trace.requests], 16, max_tokens=1024, events_every=2)
    hiops._apply = spy
    try:
        _same(ops, 16, "lru", write_policy, size=8192, ratio=16.0, check_after=("events",))
    finally:
        hiops._apply = real
    assert seen["host_hit"] > 10 and seen["loaded"] > 10 and seen["host_evicted"] > 0, seen


def test_the_memcli_profile_differs(ref):
    """split_stamp: keep (memcli) changes eviction order on the host tier too."""
    found = [run_hi_ops(generate_hi_ops(seed, 1, 150), 1, "lru", "write_through", size=144, ratio=1.5,
                        fields=FIELDS_NO_RESULT, profile="memcli") for seed in (1, 2, 3)]
    assert any(f is not None for f in found)


def test_a_wrong_threshold_is_caught(ref):
    """The harness can fail: memcli's cache with SGLang's write_through_selective threshold
    against SGLang's write_through diverges at the first backup."""
    import memcli.reference.hiops as hiops

    real = hiops._memcli_side

    def selective(size, page_size, policy, write_policy, ratio, profile):
        return real(size, page_size, policy, "write_through_selective", ratio, profile)

    hiops._memcli_side = selective
    try:
        divergence = run_hi_ops([Op("insert", _tokens(1))], 1, "lru", "write_through")
    finally:
        hiops._memcli_side = real
    assert divergence is not None and divergence.field in ("tree", "host_free_list", "sizes")
