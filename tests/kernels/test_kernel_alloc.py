"""alloc_decode_write, and the torch pieces of alloc_extend_write's reference: worked examples,
kernel vs reference vs a literal spec. (alloc_extend_write itself: test_kernel_extend_write.py.)"""

import pytest
import torch

from memcli.kernels import (
    alloc_decode_write,
    alloc_decode_write_torch,
    alloc_decode_write_triton,
    alloc_extend_write,
)
from memcli.kernels.cases import random_decode_case, random_extend_case

BACKENDS = ["triton", "torch"]
PAGE_SIZES = [1, 4, 16, 64]
# Compiled kernels on a CUDA host, the Triton interpreter on CPU (see tests/conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def i64(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def cdiv(a, b):
    return -(-a // b)


def spec_alloc_extend(prefix_lens, seq_lens, last_loc, free_pages, ps):
    """The three-part layout, literally as the reference stack describes it."""
    out, page_start = [], 0
    for pre, seq, last in zip(prefix_lens, seq_lens, last_loc):
        new_pages = cdiv(seq, ps) - cdiv(pre, ps)
        n1 = min(seq, cdiv(pre, ps) * ps) - pre
        out += [last + 1 + k for k in range(n1)]
        if pre + n1 < seq:
            n2 = seq // ps * ps - cdiv(pre, ps) * ps
            out += [free_pages[page_start + k // ps] * ps + k % ps for k in range(n2)]
            if pre + n1 + n2 < seq:
                page = free_pages[page_start + new_pages - 1]
                out += [page * ps + k for k in range(seq - seq // ps * ps)]
        page_start += new_pages
    return out


def spec_decode_slots(needs_page, last_loc, free_pages, ps):
    out, taken = [], 0
    for needs, last in zip(needs_page, last_loc):
        out.append(free_pages[taken] * ps if needs else last + 1)
        taken += int(needs)
    return out


# ----------------------------------------------------------------------------- worked examples


@pytest.mark.parametrize("backend", BACKENDS)
def test_alloc_decode_write_worked_example(backend):
    req_to_token = torch.full((4, 10), -7, dtype=torch.int32, device=DEVICE)
    req_to_token[1, :6] = torch.arange(100, 106, dtype=torch.int32)  # page 25 and 26
    req_to_token[3, :8] = torch.arange(200, 208, dtype=torch.int32)  # pages 50, 51
    before = req_to_token.clone()
    out = alloc_decode_write(i64([6, 8, 0]), i64([1, 3, 2]), req_to_token, i64([5, 9]), 4,
                             backend=backend)
    assert out.tolist() == [106, 20, 36]
    before[1, 6], before[3, 8], before[2, 0] = 106, 20, 36
    assert torch.equal(req_to_token, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_alloc_decode_write_page_size_one_takes_free_slots(backend):
    req_to_token = torch.zeros((3, 8), dtype=torch.int32, device=DEVICE)
    out = alloc_decode_write(i64([3, 0, 5]), i64([2, 0, 1]), req_to_token, i64([17, 4, 9, 30]),
                             1, backend=backend)
    assert out.tolist() == [17, 4, 9]
    assert [req_to_token[2, 3].item(), req_to_token[0, 0].item(), req_to_token[1, 5].item()] == \
        [17, 4, 9]


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_free_list_reads_as_negative_slots(backend):
    # Capacity is the caller's job; a broken promise must not read outside the free list.
    table = torch.zeros((2, 8), dtype=torch.int32, device=DEVICE)
    cpu = torch.tensor
    got = alloc_extend_write(table, [0], cpu([0]), cpu([6]), [i64([])], i64([3]), 4, backend=backend)
    assert got.out_cache_loc.tolist() == [12, 13, 14, 15, -4, -3]
    assert alloc_decode_write(i64([0, 4]), i64([1, 0]), table, i64([]), 4, backend=backend).tolist() == [-4, -4]


# ----------------------------------------------------------------------------- random cases


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_extend_by_request_on_a_cpu_matches_the_pass_per_token(page_size):
    """The CPU path of alloc_extend_write's torch reference (two slice copies per request)
    against its path for other devices (passes over every token), short free lists included."""
    from memcli.kernels.alloc import _alloc_extend_rows_cpu, _alloc_extend_tokens

    gen = torch.Generator().manual_seed(900 + page_size)
    for bs in (1, 4, 11):
        case = random_extend_case(gen, bs, page_size, max_prefix_len=90, max_extend_len=70, device="cpu")
        n = int((case.seq_lens - case.prefix_lens).sum())
        for short in (0, 1, 3):  # pages missing from the free list read as page -1
            free = case.free_pages[: max(case.free_pages.shape[0] - short, 0)]
            args = (case.prefix_lens, case.seq_lens, case.last_loc, free, page_size, n)
            assert torch.equal(_alloc_extend_rows_cpu(*args), _alloc_extend_tokens(*args))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_decode_write_random_matches_reference(page_size):
    gen = torch.Generator().manual_seed(3000 + page_size)
    for bs in (1, 6, 64):
        case = random_decode_case(gen, bs, page_size, device=DEVICE)
        needs = [s % page_size == 0 for s in case.seq_lens_before.tolist()]
        expected_out = i64(spec_decode_slots(needs, case.last_loc.tolist(), case.free_pages.tolist(), page_size))
        tables = {}
        for name, fn in (("torch", alloc_decode_write_torch),
                         ("triton", alloc_decode_write_triton)):
            tables[name] = case.req_to_token.clone()
            out = fn(case.seq_lens_before, case.req_pool_indices, tables[name],
                     case.free_pages, page_size)
            assert torch.equal(out, expected_out), name
        expected_table = case.req_to_token.clone()
        expected_table[case.req_pool_indices, case.seq_lens_before] = expected_out.to(torch.int32)
        assert torch.equal(tables["torch"], expected_table)
        assert torch.equal(tables["triton"], expected_table)


@pytest.mark.parametrize("page_size", [2, 4, 16])
def test_paged_decode_on_a_cpu_matches_the_ring_gather(page_size):
    """The CPU decode step (page-takers served from one slice of the ring) gives the slots of
    the device path's gather (`_decode_slots_torch`) wherever the free list starts, when it
    wraps past the buffer's end and when it runs short (page -1), and writes them in the rows."""
    from memcli.kernels.alloc import _decode_slots_torch

    gen = torch.Generator().manual_seed(77 + page_size)
    cap = 12
    free_pages = torch.randperm(40, generator=gen)[:cap].to(torch.int64) + 1
    for bs in (1, 5, 9):
        seq = torch.randint(0, 6, (bs,), generator=gen) * page_size  # page-takers, and some not:
        seq += torch.randint(0, 2, (bs,), generator=gen) * torch.randint(1, page_size, (bs,), generator=gen)
        rows = torch.randperm(16, generator=gen)[:bs].to(torch.int64)
        table = torch.randint(0, 1000, (16, 8 * page_size), generator=gen, dtype=torch.int32)
        last = table[rows, (seq - 1).clamp(min=0)].to(torch.int64)
        for free_start in (0, 5, cap - 1):
            for num_free in (0, 1, 3, cap):
                expected = _decode_slots_torch(seq % page_size == 0, last, free_pages, page_size, free_start, num_free)
                written = table.clone()
                out = alloc_decode_write_torch(seq, rows, written, free_pages, page_size, validate=False,
                                               free_start=free_start, num_free=num_free)
                assert torch.equal(out, expected), (bs, free_start, num_free)
                assert torch.equal(written[rows, seq], expected.to(torch.int32))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_row_writes_on_a_cpu_match_the_cell_by_cell_path(page_size):
    """The CPU path of alloc_extend_write's row writes (two slice copies per request) against
    its path for other devices (one index per written cell)."""
    from memcli.kernels.alloc import _cells, _write_rows_cpu, _write_rows_torch

    gen = torch.Generator().manual_seed(950 + page_size)
    for bs in (1, 4, 11):
        case = random_extend_case(gen, bs, page_size, max_prefix_len=60, max_extend_len=40, device="cpu")
        n = int((case.seq_lens - case.prefix_lens).sum())
        rows = torch.randperm(bs + 3, generator=gen)[:bs]
        new = torch.randint(1, 10_000, (n,), generator=gen)
        args = (rows, case.prefix_lens, case.seq_lens, new, case.prefix_flat)
        by_request, by_cell = (torch.full((bs + 3, 110), -7, dtype=torch.int32) for _ in range(2))
        _write_rows_cpu(by_request, *args)
        for begin, end, values in ((torch.zeros_like(case.prefix_lens), case.prefix_lens, case.prefix_flat),
                                   (case.prefix_lens, case.seq_lens, new)):
            r, c = _cells(rows, begin, end, values.shape[0])
            by_cell[r, c] = values.to(torch.int32)
        assert torch.equal(by_request, by_cell)
        via_dispatch = torch.full((bs + 3, 110), -7, dtype=torch.int32)
        _write_rows_torch(via_dispatch, *args)
        assert torch.equal(via_dispatch, by_request)


def test_page_size_one_decode_on_a_cpu_matches_the_torch_indexing():
    """The CPU path at page size 1 (numpy views) against the torch copy and indexed write it
    replaced, on rings that wrap and ones that do not, and a batch of one."""
    from memcli.kernels.alloc import _ring_slice

    gen = torch.Generator().manual_seed(41)
    for bs, cap, start in ((1, 5, 0), (7, 20, 3), (7, 20, 16), (7, 20, 20), (64, 64, 0), (64, 100, 90)):
        free = torch.randperm(10_000, generator=gen)[:cap].to(torch.int64)
        rows = torch.randperm(80, generator=gen)[:bs].to(torch.int64)
        seq = torch.randint(0, 50, (bs,), generator=gen)
        table = torch.randint(-9, 9, (80, 50), generator=gen).to(torch.int32)
        expected_table = table.clone()
        expected = _ring_slice(free, start, bs).clone()
        expected_table[rows, seq] = expected.to(torch.int32)
        before = free.clone()
        out = alloc_decode_write_torch(seq, rows, table, free, 1, free_start=start, num_free=min(bs + 2, cap))
        assert out.dtype == torch.int64 and torch.equal(out, expected), (bs, cap, start)
        assert torch.equal(table, expected_table) and torch.equal(free, before)
        free[start % cap] = -5  # the slots come back as a copy, not a view of the free list
        assert torch.equal(out, expected)


def test_alloc_decode_write_needs_more_than_one_block():
    # 1100 requests cross the kernel's 1024-request block: the running page offset carries over.
    gen = torch.Generator().manual_seed(7)
    case = random_decode_case(gen, 1100, 4, max_len=12, device=DEVICE)
    results = []
    for fn in (alloc_decode_write_torch, alloc_decode_write_triton):
        table = case.req_to_token.clone()
        results.append((fn(case.seq_lens_before, case.req_pool_indices, table,
                           case.free_pages, 4), table))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpu_large_batches_match_reference(page_size):
    gen = torch.Generator().manual_seed(page_size)
    cuda = torch.device("cuda")
    for bs in (1, 33, 256):
        dec = random_decode_case(gen, bs, page_size, max_len=2048, device=cuda)
        t_table, r_table = dec.req_to_token.clone(), dec.req_to_token.clone()
        args = (dec.seq_lens_before, dec.req_pool_indices)
        assert torch.equal(alloc_decode_write_triton(*args, t_table, dec.free_pages, page_size),
                           alloc_decode_write_torch(*args, r_table, dec.free_pages, page_size))
        assert torch.equal(t_table, r_table)


@pytest.mark.gpu
def test_gpu_one_compile_per_page_size():
    from memcli.kernels import alloc_extend_write_triton
    from memcli.kernels._common import num_compiled_variants
    from memcli.kernels.alloc import _alloc_extend_write_kernel

    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    page_size = 32  # a page size no other test uses, so the count starts at this test
    before = num_compiled_variants(_alloc_extend_write_kernel, cuda)
    for bs, max_len in ((1, 10), (3, 100), (17, 1000), (200, 3000)):
        case = random_extend_case(gen, bs, page_size, max_len, max_len, device=cuda)
        # A free list that starts at an odd offset must not trigger an alignment variant.
        free = torch.cat([case.free_pages[:1], case.free_pages])[1:]
        table = torch.zeros((bs, 2 * max_len + 1), dtype=torch.int32, device=cuda)
        alloc_extend_write_triton(table, list(range(bs)), case.prefix_lens.cpu(), case.seq_lens.cpu(),
                                  case.prefix_slots, free, page_size)
    assert num_compiled_variants(_alloc_extend_write_kernel, cuda) == before + 1


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_random_cases_are_valid(page_size):
    gen = torch.Generator().manual_seed(4000 + page_size)
    case = random_extend_case(gen, 40, page_size, max_prefix_len=50, max_extend_len=20)
    pre, seq = case.prefix_lens, case.seq_lens
    assert int(pre.max()) <= 50 and bool(((seq - pre) >= 1).all()) and int((seq - pre).max()) <= 20
    has_prefix = pre > 0
    assert torch.equal((case.last_loc[has_prefix] + 1) % page_size, pre[has_prefix] % page_size)
    prefix_pages = set((case.prefix_flat // page_size).tolist())
    free_pages = case.free_pages.tolist()
    assert len(set(free_pages)) == len(free_pages) and 0 not in free_pages
    assert not prefix_pages & set(free_pages)
    for slots, last in zip(case.prefix_slots, case.last_loc.tolist()):
        assert len(slots) == 0 or slots[-1] == last
