"""RadixKey and MatchResult: the value types of the prefix-cache interface."""

import numpy as np
import pytest
import torch

from memcli.mem_cache.base_prefix_cache import MatchResult, RadixKey


def test_token_ids_are_int64_arrays():
    key = RadixKey([1, 2, 3, 4])
    assert key.token_ids.dtype == np.int64
    assert key.token_ids.tolist() == [1, 2, 3, 4]
    assert key.extra_key is None
    assert RadixKey(torch.tensor([5, 6]), "lora").extra_key == "lora"


@pytest.mark.parametrize("ids, n", [([1, 2, 3], 3), ([], 0), ([42], 1)])
def test_len_and_iteration(ids, n):
    key = RadixKey(ids)
    assert len(key) == n
    assert list(key) == ids


def test_int_index_returns_a_one_token_key():
    key = RadixKey([10, 20, 30], "x")
    assert key[0].token_ids.tolist() == [10]
    assert key[-1].token_ids.tolist() == [30]
    assert key[2].extra_key == "x"
    with pytest.raises(IndexError):
        key[10]


def test_slice_keeps_extra_key_and_views_the_array():
    key = RadixKey([1, 2, 3, 4, 5], "extra")
    part = key[1:4]
    assert isinstance(part, RadixKey)
    assert part.token_ids.tolist() == [2, 3, 4]
    assert part.extra_key == "extra"
    assert np.shares_memory(part.token_ids, key.token_ids)
    assert len(key[2:2]) == 0
    assert key[:] == key


def test_repr_shows_extra_key_and_first_ten_ids():
    assert repr(RadixKey([1, 2, 3], "test")) == "RadixKey(extra_key='test', token_ids=[1, 2, 3])"
    long = repr(RadixKey(list(range(15))))
    assert long == "RadixKey(extra_key=None, token_ids=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]...)"


def test_rejects_2d_ids():
    with pytest.raises(ValueError, match="1-D"):
        RadixKey([[1, 2], [3, 4]])


def test_match_result_fields():
    result = MatchResult(torch.tensor([7, 8]), "node")
    indices, node, host_node, host_hit = result
    assert indices.tolist() == [7, 8] and node == "node"
    assert result.last_node == "node"
    # Caches without a host tier report no host hit.
    assert host_node is None and host_hit == 0
