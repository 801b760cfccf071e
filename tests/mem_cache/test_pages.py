"""Page arithmetic: one convention for every length, checked against plain loops."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from memcli.mem_cache import pages


def test_scalar_helpers_worked_example():
    assert [pages.cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert pages.num_pages(9, 4) == 3 and pages.num_pages(0, 16) == 0
    assert [pages.whole_pages(n, 4) for n in (0, 3, 4, 7, 8)] == [0, 0, 1, 1, 2]
    assert [pages.align_down(n, 4) for n in (0, 3, 4, 7, 8)] == [0, 0, 4, 4, 8]
    assert [pages.align_up(n, 4) for n in (0, 1, 4, 5)] == [0, 4, 4, 8]


def test_helpers_take_arrays_and_tensors():
    lens = [0, 1, 15, 16, 17]
    assert pages.cdiv(np.array(lens), 16).tolist() == [0, 1, 1, 1, 2]
    assert pages.align_down(torch.tensor(lens), 16).tolist() == [0, 0, 0, 16, 16]
    assert pages.align_up(np.array(lens), 16).tolist() == [0, 16, 16, 16, 32]
    assert pages.whole_pages(np.array(lens), 16).tolist() == [0, 0, 0, 1, 1]


def test_page_arithmetic_imports_no_torch():
    """config.py and workload/ round through this module; it must not pull torch in."""
    import subprocess
    import sys

    code = "import sys, memcli.mem_cache.pages; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_extend_new_pages_counts_exact_pages_per_request():
    prefix, seq = torch.tensor([0, 3, 4]), torch.tensor([4, 5, 8])
    assert pages.extend_new_pages(prefix, seq, 4) == 1 + 1 + 1
    assert pages.extend_new_pages(prefix, seq, 1) == 10
    # page size 1 with the token count known answers from it
    assert pages.extend_new_pages(prefix, seq, 1, extend_num_tokens=10) == 10
    # the lengths as lists (an extend plan's own) count the same
    assert pages.extend_new_pages([0, 3, 4], [4, 5, 8], 4) == 1 + 1 + 1
    assert pages.extend_new_pages([0, 3, 4], [4, 5, 8], 1) == 10


def test_decode_new_pages_takes_the_lengths_before_the_step():
    before = torch.tensor([4, 5, 8, 9])  # new positions 4, 5, 8, 9: 4 and 8 start a page
    assert pages.decode_new_pages(before, 4) == 2
    assert pages.decode_new_pages(before, 1) == 4
    assert pages.decode_new_pages(torch.empty(0, dtype=torch.int64), 4) == 0


@given(st.lists(st.integers(0, 100), max_size=20), st.sampled_from([1, 2, 4, 16]))
def test_page_counts_match_plain_loops(seq_lens, ps):
    seq = torch.tensor(seq_lens, dtype=torch.int64)
    assert pages.decode_new_pages(seq, ps) == sum(1 for s in seq_lens if s % ps == 0)
    prefix = torch.tensor([s // 2 for s in seq_lens], dtype=torch.int64)
    expected = sum(-(-s // ps) - -(-(s // 2) // ps) for s in seq_lens)
    assert pages.extend_new_pages(prefix, seq, ps) == expected


@pytest.mark.parametrize("ps", [1, 4])
def test_decode_new_pages_counts_what_the_allocator_takes(ps):
    from memcli.mem_cache.allocator import make_allocator

    allocator = make_allocator(64, ps, torch.device("cpu"), "torch")
    table = torch.zeros(2, 16, dtype=torch.int32)
    seq = torch.tensor([4, 6])
    before = allocator.available_size()
    allocator.alloc_decode_write(seq, seq.clone(), torch.tensor([0, 1]), table)
    assert before - allocator.available_size() == pages.decode_new_pages(seq, ps) * ps


def test_output_room_keeps_the_prompt_pages_one_page_and_a_token():
    assert pages.output_room(4096, 4000, 16) == 4096 - 4000 - 16 - 1
    assert pages.output_room(4096, 4001, 16) == 4096 - 4016 - 16 - 1  # the prompt's last page is whole
    assert pages.output_room(4096, 4090, 16) == 0  # never below 0
    assert pages.output_room(100, 10, 1) == 100 - 10 - 1 - 1


@pytest.mark.parametrize("ps", [1, 2, 3, 4, 16, 64])
def test_page_ids_are_the_floor_division_for_every_slot(ps):
    """`page_ids` (an arithmetic shift for a power-of-two page) answers `slots // page_size`
    for slots inside, below and past a pool, at both widths; the ownership ledger's ids are
    the same."""
    from memcli.mem_cache.integrity.ownership import OwnershipLedger

    ledger = OwnershipLedger(64, ps, 4)
    slots = np.arange(-3 * ps - 5, 70 * ps + 5, dtype=np.int64)
    for values in (slots, slots.astype(np.int32)):
        got = pages.page_ids(values, ps)
        assert got.dtype == values.dtype and np.array_equal(got, values if ps == 1 else values // ps)
        assert np.array_equal(ledger.page_ids(values), got)
