"""memcli's block manager against vLLM 0.33's real `KVCacheManager`, operation by operation:
equal hits, block ids, hashes, free-queue order, cached map, reference counts, stats, events."""

import pytest

from memcli.mem_cache.block_pool import block_hashes, none_hash, sha256
from memcli.reference.vllm033.ops import ManagerPair, random_ops


@pytest.mark.parametrize("seed", range(12))
def test_random_operation_sequences_agree(vllm_ref, seed):
    pair = random_ops(seed, steps=250, num_blocks=16 + seed % 4 * 8, block_size=(2, 4, 16)[seed % 3])
    kinds = {entry[0] for entry in pair.log}
    assert kinds == {"admit", "extend", "free"}
    assert pair.mem.pool.evicted or seed % 4 == 3  # the small pools evict


def test_hashes_are_vllms_sha256_chain(vllm_ref):
    kv = vllm_ref.kv_cache_utils
    assert kv.NONE_HASH == none_hash()
    tokens = list(range(10))
    ours = block_hashes(tokens, 4)
    parent = None
    for i, h in enumerate(ours):
        parent = kv.hash_block_tokens(vllm_ref.hashing.sha256, parent, tokens[4 * i:4 * i + 4])
        assert parent == h
    assert sha256((1, 2)) == vllm_ref.hashing.sha256((1, 2))


def test_last_token_rule_loses_a_whole_block_and_salt_separates(vllm_ref):
    pair = ManagerPair(num_blocks=10, block_size=4)
    pair.admit("a", list(range(8)))
    pair.free("a")
    (real_hit, _), (mem_hit, _) = pair.admit("b", list(range(8)))
    assert real_hit == mem_hit == 4  # L = 8 is a multiple of the block: the last block is recomputed
    pair.free("b")
    (real_hit, _), (mem_hit, _) = pair.admit("c", list(range(8)), salt="other")
    assert real_hit == mem_hit == 0
    assert pair.compare() == []


@pytest.mark.parametrize("seed", range(3))
def test_without_prefix_caching_too(vllm_ref, seed):
    pair = random_ops(seed, steps=150, num_blocks=20, block_size=4, enable_caching=False)
    assert not pair.mem.pool.cached and pair.mem.stats.queries == 0
