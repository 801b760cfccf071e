"""RequestSpec token sources, block hashes, and the output-token base."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from memcli.workload.spec import SYNTHETIC_TOKEN_BASE, RequestSpec, Trace, chained_block_hashes, output_token_base


def mooncake(rid: str, hash_ids: list[int], input_len: int, block_size: int = 4) -> RequestSpec:
    return RequestSpec(rid=rid, input_len=input_len, output_len=1, hash_ids=tuple(hash_ids), block_size=block_size)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def test_mooncake_tokens_are_hash_times_block_size_plus_offset():
    spec = mooncake("a", [7, 2, 9], input_len=10)
    assert spec.input_ids().tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 36, 37]
    assert spec.input_ids().dtype == np.int64
    assert spec.num_blocks == 3
    assert spec.block_hashes() == (7, 2, 9)
    assert spec.max_token_id == 9 * 4 + 3


def test_mooncake_requests_share_exactly_their_shared_blocks():
    a = mooncake("a", [0, 1, 2, 3], input_len=16)
    b = mooncake("b", [0, 1, 5], input_len=11)
    c = mooncake("c", [0, 1], input_len=6)
    assert common_prefix_len(a.input_ids(), b.input_ids()) == 2 * 4
    # c ends inside the second shared block: it shares all of its 6 tokens with a.
    assert common_prefix_len(a.input_ids(), c.input_ids()) == 6


@given(
    shared=st.lists(st.integers(0, 50), max_size=5),
    tail_a=st.lists(st.integers(51, 100), max_size=4, unique=True),
    tail_b=st.lists(st.integers(101, 150), max_size=4, unique=True),
    block_size=st.integers(1, 6),
    data=st.data(),
)
def test_shared_hash_prefix_means_shared_token_prefix(shared, tail_a, tail_b, block_size, data):
    ids_a, ids_b = shared + tail_a, shared + tail_b
    if not ids_a or not ids_b:
        return
    len_a = data.draw(st.integers((len(ids_a) - 1) * block_size + 1, len(ids_a) * block_size))
    len_b = data.draw(st.integers((len(ids_b) - 1) * block_size + 1, len(ids_b) * block_size))
    a = mooncake("a", ids_a, len_a, block_size)
    b = mooncake("b", ids_b, len_b, block_size)
    shared_tokens = len(shared) * block_size if tail_a and tail_b else len(shared) * block_size + block_size
    expected = min(shared_tokens, len_a, len_b)
    assert common_prefix_len(a.input_ids(), b.input_ids()) == expected
    assert len(a.input_ids()) == len_a


def test_hash_ids_must_match_the_block_count():
    with pytest.raises(ValueError, match="need 3"):
        mooncake("a", [1, 2], input_len=9)


def test_exactly_one_token_source():
    with pytest.raises(ValueError, match="exactly one"):
        RequestSpec(rid="a", input_len=1, output_len=1)
    with pytest.raises(ValueError, match="exactly one"):
        RequestSpec(rid="a", input_len=1, output_len=1, hash_ids=(1,), token_runs=(range(1),))


def test_token_runs_are_concatenated_and_input_ids_is_a_fresh_copy():
    arr = np.array([5, 6, 7], dtype=np.int64)
    spec = RequestSpec(rid="a", input_len=5, output_len=2, token_runs=(arr, range(100, 102)))
    ids = spec.input_ids()
    assert ids.tolist() == [5, 6, 7, 100, 101]
    ids[0] = -1
    assert spec.input_ids()[0] == 5
    assert spec.max_token_id == 101


def test_from_ids_freezes_its_array():
    spec = RequestSpec.from_ids("a", [3, 1, 2], output_len=4, arrival_ms=1.5)
    assert spec.input_len == 3 and spec.arrival_ms == 1.5
    assert not spec.token_runs[0].flags.writeable
    assert spec.input_ids().tolist() == [3, 1, 2]


def test_memcli_block_hashes_are_chained():
    a = RequestSpec.from_ids("a", list(range(10)), output_len=1, block_size=4)
    b = RequestSpec.from_ids("b", list(range(8)) + [99, 98], output_len=1, block_size=4)
    c = RequestSpec.from_ids("c", [0, 1, 2, 3, 77, 5, 6, 7, 8, 9], output_len=1, block_size=4)
    ha, hb, hc = a.block_hashes(), b.block_hashes(), c.block_hashes()
    assert len(ha) == a.num_blocks == 3
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    # One different token in block 1 changes every later block id, though block 2 is equal.
    assert ha[0] == hc[0] and ha[1] != hc[1] and ha[2] != hc[2]
    assert all(0 <= h < 2**63 for h in ha)
    assert ha == chained_block_hashes(a.input_ids(), 4)


def test_output_token_base_is_above_every_input_token():
    requests = [
        RequestSpec.from_ids("a", [10, 20], output_len=1),
        RequestSpec(rid="b", input_len=3, output_len=1, token_runs=(range(SYNTHETIC_TOKEN_BASE, SYNTHETIC_TOKEN_BASE + 3),)),
    ]
    trace = Trace(Path("x.jsonl"), "memcli", 512, requests)
    assert trace.max_token_id == SYNTHETIC_TOKEN_BASE + 2
    assert output_token_base(trace) == SYNTHETIC_TOKEN_BASE + 3
    assert trace.num_requests == 2 and trace.input_tokens == 5 and trace.output_tokens == 2
    assert not trace.has_timestamps


def test_mooncake_output_base_bounds_partial_blocks_too():
    trace = Trace(Path("x.jsonl"), "mooncake", 4, [mooncake("a", [3, 8], input_len=5), mooncake("b", [3], input_len=2)])
    top = max(int(r.input_ids().max()) for r in trace.requests)
    assert output_token_base(trace) > top
    assert output_token_base(trace) == 8 * 4 + 4
