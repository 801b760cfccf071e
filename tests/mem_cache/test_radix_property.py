"""Random insert / match / lock / unlock / evict sequences against a simple model.

The model is the set of cached pages: `(extra_key, tokens up to the end of the page)` ->
slots of that page. Without eviction the tree must hold exactly the model; a match must
return the longest page-aligned prefix the model holds, with its slots. An eviction may
remove only unlocked pages, never leaves a gap (the model stays prefix-closed), frees
exactly what it reports, and frees all it was asked for unless nothing evictable is left.
check_integrity() and slot conservation hold after every step; with KV events on, the
replayed events always describe the tree.
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memcli.mem_cache.base_prefix_cache import RadixKey
from memcli.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from memcli.mem_cache.radix_cache import RadixCache
from tests.mem_cache.fakes import FakeAllocator

POOL_SIZE = 512

# Prefixes of a few overlapping base sequences plus a short random tail: lots of shared
# prefixes and divergence at every position, so splits (also of locked nodes) are common.
BASES = ([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 2, 2, 2, 2, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0, 0, 2, 2])
tokens_st = st.builds(
    lambda base, cut, tail: base[:cut] + tail,
    st.sampled_from(BASES), st.integers(0, 12), st.lists(st.integers(0, 2), max_size=4),
)
extra_st = st.sampled_from([None, None, "lora"])
op_st = st.one_of(
    st.tuples(st.just("insert"), tokens_st, extra_st),
    st.tuples(st.just("match"), tokens_st, extra_st),
    st.tuples(st.just("lock"), tokens_st, extra_st),
    st.tuples(st.just("unlock"), st.integers(0, 7)),
    st.tuples(st.just("evict"), st.integers(0, 24)),
    st.tuples(st.just("tick"), st.integers(1, 3)),
)


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def tree_pages(cache):
    """What the tree holds, in the model's form (read-only walk)."""
    pages, stack = {}, [(child, ()) for child in cache.root.children.values()]
    ps = cache.page_size
    while stack:
        node, path = stack.pop()
        tokens, slots = node.key.tolist(), node.value.tolist()
        for i in range(0, len(tokens), ps):
            path = path + tuple(tokens[i : i + ps])
            pages[(node.extra_key, path)] = tuple(slots[i : i + ps])
        stack.extend((child, path) for child in node.children.values())
    return pages


def model_match(model, tokens, extra, ps):
    slots, end = [], ps
    while end <= len(tokens) and (extra, tuple(tokens[:end])) in model:
        slots.extend(model[(extra, tuple(tokens[:end]))])
        end += ps
    return slots


class Run:
    def __init__(self, page_size):
        self.ps = page_size
        self.allocator = FakeAllocator(POOL_SIZE, page_size)
        self.cache = RadixCache(None, self.allocator, page_size, eviction_policy="lru", kv_events=True)
        self.cache.clock = self.clock = Clock()
        self.model = {}
        self.locks = []  # (node, extra, locked tokens)
        self.hashes = set()

    def insert(self, tokens, extra):
        aligned = len(tokens) - len(tokens) % self.ps
        expected_prefix = len(model_match(self.model, tokens[:aligned], extra, self.ps))
        if self.allocator.available_size() < aligned:
            return
        slots = self.allocator.alloc(aligned)
        tail = torch.zeros(len(tokens) - aligned, dtype=torch.int64)  # not stored: shorter than a page
        assert self.cache.insert(RadixKey(tokens, extra), torch.cat([slots, tail])) == expected_prefix
        if expected_prefix:
            self.allocator.free(slots[:expected_prefix])
        for end in range(expected_prefix + self.ps, aligned + 1, self.ps):
            self.model[(extra, tuple(tokens[:end]))] = tuple(slots[end - self.ps : end].tolist())

    def match(self, tokens, extra):
        result = self.cache.match_prefix(RadixKey(tokens, extra))
        assert result.device_indices.tolist() == model_match(self.model, tokens, extra, self.ps)
        return result

    def lock(self, tokens, extra):
        result = self.match(tokens, extra)
        self.cache.inc_lock_ref(result.last_node)
        self.locks.append((result.last_node, extra, tuple(tokens[: len(result.device_indices)])))

    def unlock(self, i):
        if self.locks:
            node, _, _ = self.locks.pop(i % len(self.locks))
            self.cache.dec_lock_ref(node)

    def evict(self, n):
        before = dict(self.model)
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(n)
        after = tree_pages(self.cache)
        assert all(before[k] == v for k, v in after.items()) and after.keys() <= before.keys()
        assert freed == self.ps * (len(before) - len(after))
        assert freed >= min(n, evictable)
        if freed < n:
            assert self.cache.evictable_size() == 0
        for _, extra, tokens in self.locks:
            for end in range(self.ps, len(tokens) + 1, self.ps):
                assert (extra, tokens[:end]) in after, "a locked page was evicted"
        self.model = after

    def check(self):
        self.cache.check_integrity().raise_if_failed()
        assert tree_pages(self.cache) == self.model
        assert self.allocator.available_size() + self.cache.total_size() == POOL_SIZE
        locked = {(extra, tokens[:end]) for _, extra, tokens in self.locks
                  for end in range(self.ps, len(tokens) + 1, self.ps)}
        assert self.cache.protected_size() == self.ps * len(locked)
        for event in self.cache.take_events():
            if isinstance(event, BlockStored):
                assert event.block_hashes[0] not in self.hashes
                self.hashes.add(event.block_hashes[0])
            elif isinstance(event, BlockRemoved):
                self.hashes.remove(event.block_hashes[0])
            else:
                assert isinstance(event, AllBlocksCleared)
                self.hashes.clear()
        assert self.hashes == {e.block_hashes[0] for e in self.cache.snapshot_events()}

    def step(self, op):
        kind = op[0]
        if kind == "tick":
            self.clock.now += op[1]
        elif kind in ("insert", "match", "lock"):
            getattr(self, kind)(op[1], op[2])
        else:
            getattr(self, kind)(op[1])
        self.check()


def run_ops(page_size, ops):
    run = Run(page_size)
    for op in ops:
        run.step(op)
    while run.locks:
        run.unlock(0)
        run.check()
    assert run.cache.protected_size() == 0
    run.evict(POOL_SIZE)
    run.check()
    assert run.cache.total_size() == 0 and run.allocator.available_size() == POOL_SIZE


SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(op_st, max_size=40))
def test_random_ops_page_size_1(ops):
    run_ops(1, ops)


@SETTINGS
@given(st.lists(op_st, max_size=40))
def test_random_ops_page_size_4(ops):
    run_ops(4, ops)


@SETTINGS
@given(st.lists(st.tuples(st.just("insert"), tokens_st, extra_st), max_size=12), st.lists(tokens_st, max_size=8))
def test_without_eviction_match_is_the_longest_page_floored_common_prefix(inserts, queries):
    """The plainest model: only the inserted sequences, no slots, no eviction."""
    for ps in (1, 4):
        cache = RadixCache(None, None, ps)
        stored = []
        for _, tokens, extra in inserts:
            cache.insert(RadixKey(tokens, extra))
            stored.append((extra, tokens))
        for query in queries:
            for extra in (None, "lora"):
                best = 0
                for stored_extra, tokens in stored:
                    if stored_extra != extra:
                        continue
                    common = 0
                    while common < min(len(tokens), len(query)) and tokens[common] == query[common]:
                        common += 1
                    best = max(best, common // ps * ps)
                assert len(cache.match_prefix(RadixKey(query, extra)).device_indices) == best
