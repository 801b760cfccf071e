"""write_cache_indices and get_last_loc: exact rows, kernel vs reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memcli.kernels import (
    alloc_extend_torch,
    get_last_loc,
    get_last_loc_torch,
    get_last_loc_triton,
    write_cache_indices,
    write_cache_indices_torch,
    write_cache_indices_triton,
)
from memcli.kernels.cases import random_decode_case, random_extend_case

BACKENDS = ["triton", "torch"]
SENTINEL = -7
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def i64(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def table(rows, cols, fill=SENTINEL):
    return torch.full((rows, cols), fill, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_cache_indices_exact_rows(backend):
    req_to_token = table(4, 8)
    write_cache_indices(
        req_to_token,
        req_pool_indices=i64([2, 0, 3]),
        prefix_lens=i64([3, 0, 2]),
        seq_lens=i64([5, 2, 6]),
        out_cache_loc=i64([10, 11, 20, 21, 30, 31, 32, 33]),
        prefix_flat=i64([7, 8, 9, 40, 41]),
        backend=backend,
    )
    s = SENTINEL
    assert req_to_token.tolist() == [
        [20, 21, s, s, s, s, s, s],
        [s, s, s, s, s, s, s, s],
        [7, 8, 9, 10, 11, s, s, s],
        [40, 41, 30, 31, 32, 33, s, s],
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_cache_indices_without_prefixes(backend):
    req_to_token = table(2, 4)
    write_cache_indices(req_to_token, i64([1, 0]), i64([0, 0]), i64([3, 1]), i64([5, 6, 7, 8]),
                        i64([]), backend=backend)
    assert req_to_token.tolist() == [[8, SENTINEL, SENTINEL, SENTINEL], [5, 6, 7, SENTINEL]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_cache_indices_rejects_int32_prefix(backend):
    req_to_token = table(2, 4, fill=0)
    prefix = req_to_token[0, :2]  # an int32 view of the table: the classic mistake
    with pytest.raises(ValueError, match="prefix_flat must be torch.int64, got torch.int32"):
        write_cache_indices(req_to_token, i64([1]), i64([2]), i64([3]), i64([9]), prefix,
                            backend=backend)


def _random_write_case(gen, bs, page_size, spare_rows=3):
    case = random_extend_case(gen, bs, page_size, max_prefix_len=60, max_extend_len=60,
                              device=DEVICE)
    out_cache_loc = alloc_extend_torch(case.prefix_lens, case.seq_lens, case.last_loc,
                                       case.free_pages, page_size, case.extend_num_tokens)
    num_rows = bs + spare_rows
    req_pool_indices = torch.randperm(num_rows, generator=gen)[:bs].to(DEVICE)
    cols = int(case.seq_lens.max()) + int(torch.randint(0, 4, (1,), generator=gen))
    req_to_token = table(num_rows, cols)
    return case, out_cache_loc, req_pool_indices, req_to_token


def _expected_table(case, out_cache_loc, req_pool_indices, req_to_token):
    expected = req_to_token.clone()
    new = torch.split(out_cache_loc, (case.seq_lens - case.prefix_lens).tolist())
    for rp, pre, seq, prefix, slots in zip(req_pool_indices.tolist(), case.prefix_lens.tolist(),
                                           case.seq_lens.tolist(), case.prefix_slots, new):
        expected[rp, :pre] = prefix.to(torch.int32)
        expected[rp, pre:seq] = slots.to(torch.int32)
    return expected


def _check_random_write(seed, bs, page_size):
    gen = torch.Generator().manual_seed(seed)
    case, out_cache_loc, req_pool_indices, start = _random_write_case(gen, bs, page_size)
    expected = _expected_table(case, out_cache_loc, req_pool_indices, start)
    for fn in (write_cache_indices_torch, write_cache_indices_triton):
        got = start.clone()
        fn(got, req_pool_indices, case.prefix_lens, case.seq_lens, out_cache_loc, case.prefix_flat)
        assert torch.equal(got, expected), fn.__name__
    return case, req_pool_indices, expected


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
@pytest.mark.parametrize("bs", [1, 9, 64])
def test_write_cache_indices_random_matches_reference(bs, page_size):
    _check_random_write(100 * bs + page_size, bs, page_size)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), bs=st.integers(1, 64), page_size=st.sampled_from([1, 4, 16, 64]))
def test_write_then_get_last_loc_round_trip(seed, bs, page_size):
    case, req_pool_indices, written = _check_random_write(seed, bs, page_size)
    for fn in (get_last_loc_torch, get_last_loc_triton):
        assert torch.equal(fn(written, req_pool_indices, case.prefix_lens), case.last_loc)


@pytest.mark.parametrize("backend", BACKENDS)
def test_get_last_loc_exact(backend):
    req_to_token = torch.tensor([[4, 5, 6], [8, 9, 10], [12, 13, 14]], dtype=torch.int32,
                                device=DEVICE)
    out = get_last_loc(req_to_token, i64([2, 0, 1]), i64([2, 0, 3]), backend=backend)
    assert out.dtype == torch.int64
    assert out.tolist() == [13, -1, 10]


@pytest.mark.parametrize("bs", [1, 300])
def test_get_last_loc_random_matches_reference(bs):
    gen = torch.Generator().manual_seed(bs)
    case = random_decode_case(gen, bs, 16, device=DEVICE)
    args = (case.req_to_token, case.req_pool_indices, case.seq_lens_before)
    assert torch.equal(get_last_loc_triton(*args), get_last_loc_torch(*args))
    assert torch.equal(get_last_loc_torch(*args), case.last_loc)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpu_write_cache_indices_large(page_size):
    gen = torch.Generator().manual_seed(page_size)
    cuda = torch.device("cuda")
    for bs in (1, 100, 256):
        case = random_extend_case(gen, bs, page_size, 2048, 2048, device=cuda)
        out_cache_loc = alloc_extend_torch(case.prefix_lens, case.seq_lens, case.last_loc,
                                           case.free_pages, page_size, case.extend_num_tokens)
        rows = torch.randperm(bs + 5, generator=gen)[:bs].to(cuda)
        got = torch.full((bs + 5, 4100), SENTINEL, dtype=torch.int32, device=cuda)
        ref = got.clone()
        args = (rows, case.prefix_lens, case.seq_lens, out_cache_loc, case.prefix_flat)
        write_cache_indices_triton(got, *args)
        write_cache_indices_torch(ref, *args)
        assert torch.equal(got, ref)
        assert torch.equal(get_last_loc_triton(got, rows, case.prefix_lens), case.last_loc)
