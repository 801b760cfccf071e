"""alloc_decode_step: the decode memory path with the free list's state on the device."""

import pytest
import torch

from memcli.kernels import (alloc_decode_step, alloc_decode_write_torch, pack_free_state, unpack_free_state)
from tests.kernels.test_kernel_alloc import DEVICE

BACKENDS = ["triton", "torch"]


def i64(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def test_state_packs_head_and_length():
    assert unpack_free_state(pack_free_state(7, 123)) == (7, 123)
    assert unpack_free_state(pack_free_state(0, 0)) == (0, 0)
    with pytest.raises(ValueError, match="32 bits"):
        pack_free_state(1 << 32, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_worked_example_paged_stack(backend):
    # ps 4, the stack holds pages [.., 5, 9, 3] from head 1; lengths before: 8 (opens a page),
    # 6 (shares: last slot 41 -> 42), 4 (opens a page).
    table = torch.zeros((3, 16), dtype=torch.int32, device=DEVICE)
    table[1, 5] = 41
    seq = i64([8, 6, 4])
    state = i64([pack_free_state(1, 3)])
    free = i64([99, 5, 9, 3])
    out = alloc_decode_step(seq, i64([0, 1, 2]), table, free, state, 4, ring=False, backend=backend)
    assert out.tolist() == [20, 42, 36]
    assert table[0, 8].item() == 20 and table[1, 6].item() == 42 and table[2, 4].item() == 36
    assert seq.tolist() == [9, 7, 5]  # incremented in place
    assert unpack_free_state(int(state.item())) == (3, 1)  # two pages taken from the stack


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_head_wraps(backend):
    table = torch.zeros((2, 8), dtype=torch.int32, device=DEVICE)
    free = i64([7, 8, 9, 4])
    state = i64([pack_free_state(3, 3)])  # ring of 3 entries from index 3: 4, 7, 8
    out = alloc_decode_step(i64([2, 5]), i64([1, 0]), table, free, state, 1, ring=True, backend=backend)
    assert out.tolist() == [4, 7]
    assert unpack_free_state(int(state.item())) == (1, 1)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_steps_match_the_host_driven_kernel(backend, page_size):
    """Ten steps with the state on the device give the slots of the host-driven path, whose
    head and length the host advances itself."""
    gen = torch.Generator().manual_seed(page_size)
    bs, cap = 5, 64  # ten steps of page size 1 take 50 entries
    free = torch.randperm(cap, generator=gen).to(DEVICE) + 1
    lens = (torch.randint(1, 12, (bs,), generator=gen) * (1 if page_size == 1 else page_size)).to(DEVICE)
    rows = torch.tensor([3, 0, 4, 1, 2], device=DEVICE)
    t_dev = torch.randint(0, 100, (5, 64), generator=gen, dtype=torch.int32).to(DEVICE)
    t_host = t_dev.clone()
    seq_dev, seq_host = lens.clone(), lens.clone()
    ring = page_size == 1
    head, num = 0, cap
    state = i64([pack_free_state(head, num)])
    out = torch.empty(bs, dtype=torch.int64, device=DEVICE)
    for _ in range(10):
        expect = alloc_decode_write_torch(seq_host, rows, t_host, free, page_size, True, head, num)
        taken = int((seq_host % page_size == 0).sum())
        head = (head + taken) % cap if ring else head + taken
        num -= taken
        seq_host = seq_host + 1
        got = alloc_decode_step(seq_dev, rows, t_dev, free, state, page_size, ring, out=out, backend=backend)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(got, expect)
        assert torch.equal(seq_dev, seq_host) and torch.equal(t_dev, t_host)
        assert unpack_free_state(int(state.item())) == (head, num)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_state_is_rejected(backend):
    table = torch.zeros((2, 8), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="state"):
        alloc_decode_step(i64([1]), i64([0]), table, i64([1, 2]), i64([0, 0]), 1, True, backend=backend)
    with pytest.raises(ValueError, match="free_start"):
        alloc_decode_step(i64([1]), i64([0]), table, i64([1, 2]), i64([pack_free_state(5, 1)]), 1, True,
                          backend=backend)


def test_the_decode_block_follows_the_batch_up_to_its_cap():
    from memcli.kernels.alloc import _DECODE_BLOCK, _decode_block

    assert [_decode_block(n) for n in (1, 16, 17, 32, 256, 257)] == [16, 16, 32, 32, 256, 512]
    assert _decode_block(_DECODE_BLOCK) == _decode_block(5 * _DECODE_BLOCK) == _DECODE_BLOCK


@pytest.mark.parametrize("bs", [17, 1100])  # a partly masked block; two loop steps of the widest block
@pytest.mark.parametrize("page_size", [1, 4])
def test_step_matches_the_torch_reference_across_block_sizes(bs, page_size):
    gen = torch.Generator().manual_seed(bs)
    lens = torch.randint(1, 6, (bs,), generator=gen).to(DEVICE) * 2
    rows = torch.randperm(bs, generator=gen).to(DEVICE)
    cap = bs + 8
    free = torch.randperm(cap, generator=gen).to(DEVICE) + 1
    results = []
    for backend in BACKENDS:
        table = torch.zeros((bs, 16), dtype=torch.int32, device=DEVICE)
        table[:, :12] = torch.arange(12, dtype=torch.int32, device=DEVICE) + 1000  # the last slots' pages
        seq, state = lens.clone(), i64([pack_free_state(3, bs)])
        out = alloc_decode_step(seq, rows, table, free, state, page_size, ring=page_size == 1, backend=backend)
        results.append((out.cpu(), table.cpu(), seq.cpu(), int(state.item())))
    (out_t, table_t, seq_t, state_t), (out_r, table_r, seq_r, state_r) = results
    assert torch.equal(out_t, out_r) and torch.equal(table_t, table_r) and torch.equal(seq_t, seq_r)
    assert state_t == state_r
