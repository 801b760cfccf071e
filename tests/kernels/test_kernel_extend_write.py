"""alloc_extend_write (fused extend: slots + rows) and the direct-launch `Launcher`."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton

from memcli.kernels import alloc_extend_write, alloc_extend_write_torch, alloc_extend_write_triton, extend_host_plan
from memcli.kernels._common import Launcher, _unspecialised, next_power_of_2
from memcli.kernels.cases import random_extend_case
from tests.kernels.test_kernel_alloc import DEVICE, PAGE_SIZES, spec_alloc_extend

BACKENDS = ["triton", "torch"]
SENTINEL = -7


def table(rows, cols):
    return torch.full((rows, cols), SENTINEL, dtype=torch.int32, device=DEVICE)


def cpu(values):
    return torch.tensor(values, dtype=torch.int64)


def write_case(case, rows, fn, spare_rows=2):
    """Run `fn` (an alloc_extend_write backend) on an ExtendCase; returns (result, table)."""
    t = table(max(rows, default=0) + 1 + spare_rows, int(case.seq_lens.max()) + 3 if len(rows) else 4)
    result = fn(t, rows, case.prefix_lens.cpu(), case.seq_lens.cpu(), case.prefix_slots, case.free_pages,
                case.page_size)
    return result, t


@pytest.mark.parametrize("backend", BACKENDS)
def test_worked_example_slots_and_rows(backend):
    # ps 4; (pre, seq): (0, 6), (5, 11) with a prefix ending at slot 40, (8, 9) ending at 47.
    prefixes = [torch.empty(0, dtype=torch.int64, device=DEVICE),
                torch.tensor([20, 21, 22, 23, 40], device=DEVICE),
                torch.tensor([28, 29, 30, 31, 44, 45, 46, 47], device=DEVICE)]
    t = table(4, 12)
    free = torch.arange(1, 9, device=DEVICE)
    got = alloc_extend_write(t, [2, 0, 3], cpu([0, 5, 8]), cpu([6, 11, 9]), prefixes, free, 4, backend=backend)
    assert got.out_cache_loc.tolist() == [4, 5, 6, 7, 8, 9, 41, 42, 43, 12, 13, 14, 16]
    assert t[2, :6].tolist() == [4, 5, 6, 7, 8, 9]
    assert t[0, :11].tolist() == [20, 21, 22, 23, 40, 41, 42, 43, 12, 13, 14]
    assert t[3, :9].tolist() == [28, 29, 30, 31, 44, 45, 46, 47, 16]
    assert t[1].tolist() == [SENTINEL] * 12  # an unused row is untouched
    assert t[2, 6:].tolist() == [SENTINEL] * 6 and t[0, 11:].tolist() == [SENTINEL]
    assert got.req_pool_indices.tolist() == [2, 0, 3]
    assert got.prefix_lens.tolist() == [0, 5, 8] and got.seq_lens.tolist() == [6, 11, 9]
    assert got.out_cache_loc.dtype == got.seq_lens.dtype == torch.int64


@pytest.mark.parametrize("backend", BACKENDS)
def test_page_size_one_takes_the_free_list_in_order(backend):
    prefixes = [torch.tensor([50, 51], device=DEVICE), torch.empty(0, dtype=torch.int64, device=DEVICE)]
    free = torch.tensor([9, 3, 7, 1, 8], device=DEVICE)
    t = table(2, 6)
    got = alloc_extend_write(t, [1, 0], cpu([2, 0]), cpu([4, 2]), prefixes, free, 1, backend=backend)
    assert got.out_cache_loc.tolist() == [9, 3, 7, 1]
    assert t[1, :4].tolist() == [50, 51, 9, 3] and t[0, :2].tolist() == [7, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_only_and_empty_batches(backend):
    t = table(2, 4)
    prefix = torch.tensor([12, 13, 14], device=DEVICE)
    got = alloc_extend_write(t, [1], cpu([3]), cpu([3]), [prefix], torch.tensor([5], device=DEVICE), 4,
                             backend=backend)
    assert got.out_cache_loc.numel() == 0 and t[1, :3].tolist() == [12, 13, 14]
    empty = alloc_extend_write(t, [], cpu([]), cpu([]), [], torch.tensor([5], device=DEVICE), 4, backend=backend)
    assert empty.out_cache_loc.numel() == 0 and empty.req_pool_indices.numel() == 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_random_batches_match_reference_and_spec(page_size):
    gen = torch.Generator().manual_seed(700 + page_size)
    for bs in (1, 3, 9):
        case = random_extend_case(gen, bs, page_size, max_prefix_len=40, max_extend_len=40, device=DEVICE)
        rows = torch.randperm(bs + 2, generator=gen)[:bs].tolist()
        kernel, t_kernel = write_case(case, rows, alloc_extend_write_triton)
        ref, t_ref = write_case(case, rows, alloc_extend_write_torch)
        assert torch.equal(kernel.out_cache_loc, ref.out_cache_loc)
        assert torch.equal(t_kernel, t_ref)
        spec = spec_alloc_extend(case.prefix_lens.tolist(), case.seq_lens.tolist(), case.last_loc.tolist(),
                                 case.free_pages.tolist(), page_size)
        assert kernel.out_cache_loc.tolist() == spec
        offset = 0
        for row, prefix, pre, seq in zip(rows, case.prefix_slots, case.prefix_lens.tolist(),
                                         case.seq_lens.tolist()):
            assert t_kernel[row, :pre].tolist() == prefix.tolist()
            assert t_kernel[row, pre:seq].tolist() == spec[offset : offset + seq - pre]
            offset += seq - pre


def test_offsets_sum_over_more_requests_than_one_block():
    from memcli.kernels.alloc import _EXTEND_BLOCK

    gen = torch.Generator().manual_seed(11)
    case = random_extend_case(gen, _EXTEND_BLOCK + 3, 2, max_prefix_len=3, max_extend_len=3, device=DEVICE)
    rows = list(range(_EXTEND_BLOCK + 3))
    kernel, t_kernel = write_case(case, rows, alloc_extend_write_triton)
    ref, t_ref = write_case(case, rows, alloc_extend_write_torch)
    assert torch.equal(kernel.out_cache_loc, ref.out_cache_loc) and torch.equal(t_kernel, t_ref)



@pytest.mark.parametrize("page_size", [1, 16])
def test_a_request_of_many_blocks_loops_over_them(page_size):
    """A request's program loops over its prefix and new tokens block by block: a prefix of
    more than eight blocks and a request of more than twenty give the reference's slots and rows."""
    from memcli.kernels import alloc

    span = alloc._EXTEND_BLOCK * 8
    prefixes = [torch.arange(5000, 5000 + span + 37, device=DEVICE), torch.empty(0, dtype=torch.int64, device=DEVICE)]
    pre = [span + 37, 0]
    seq = [pre[0] + 2 * span + 5, span + 1]
    pages = sum((q + page_size - 1) // page_size - (p + page_size - 1) // page_size for p, q in zip(pre, seq))
    free = torch.randperm(pages + 9, generator=torch.Generator().manual_seed(3)).to(DEVICE) + 20000 // page_size
    t_kernel, t_ref = table(3, seq[0] + 2), table(3, seq[0] + 2)
    kernel = alloc_extend_write_triton(t_kernel, [2, 0], cpu(pre), cpu(seq), prefixes, free, page_size)
    ref = alloc_extend_write_torch(t_ref, [2, 0], cpu(pre), cpu(seq), prefixes, free, page_size)
    assert torch.equal(kernel.out_cache_loc, ref.out_cache_loc) and torch.equal(t_kernel, t_ref)
    assert t_kernel[2, : pre[0]].tolist() == prefixes[0].tolist()

@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_rejected(backend):
    t = table(2, 8)
    free = torch.arange(1, 5, device=DEVICE)
    one = [torch.tensor([4], device=DEVICE)]
    with pytest.raises(ValueError, match="one entry per request"):
        alloc_extend_write(t, [0, 1], cpu([1]), cpu([3]), one, free, 4, backend=backend)
    with pytest.raises(ValueError, match=r"prefixes\[0\] must be torch.int64"):
        alloc_extend_write(t, [0], cpu([1]), cpu([3]), [one[0].to(torch.int32)], free, 4, backend=backend)
    with pytest.raises(ValueError, match=r"prefixes\[0\] must have length 2"):
        alloc_extend_write(t, [0], cpu([2]), cpu([3]), one, free, 4, backend=backend)
    with pytest.raises(ValueError, match="seq_lens_cpu is on"):
        alloc_extend_write(t, [0], cpu([1]), torch.tensor([3], device="meta"), one, free, 4, backend=backend)
    with pytest.raises(ValueError, match="req_to_token must be torch.int32"):
        alloc_extend_write(t.long(), [0], cpu([1]), cpu([3]), one, free, 4, backend=backend)
    with pytest.raises(ValueError, match="request 0: seq_len 0 < prefix_len 1"):
        alloc_extend_write(t, [0], cpu([1]), cpu([0]), one, free, 4, backend=backend)
    with pytest.raises(ValueError, match=r"extend_num_tokens 1 != sum\(seq_lens - prefix_lens\) 2"):
        alloc_extend_write(t, [0], cpu([1]), cpu([3]), one, free, 4, backend=backend, extend_num_tokens=1)


def test_unvalidated_kernel_never_writes_past_its_output():
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    t = table(1, 8)
    # The caller claims 2 new tokens where the lengths give 6: only the 2 it has room for are written.
    got = alloc_extend_write_triton(t, [0], cpu([0]), cpu([6]), [empty], torch.arange(1, 5, device=DEVICE), 4,
                                    extend_num_tokens=2, validate=False)
    assert got.out_cache_loc.tolist() == [4, 5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unvalidated_call_with_the_token_count_matches(backend):
    prefixes = [torch.tensor([20, 21, 22, 23, 40], device=DEVICE), torch.empty(0, dtype=torch.int64, device=DEVICE)]
    free = torch.arange(1, 9, device=DEVICE)
    args = ([0, 1], cpu([5, 0]), cpu([11, 3]), prefixes, free, 4)
    t1, t2 = table(2, 12), table(2, 12)
    checked = alloc_extend_write(t1, *args, backend=backend)
    trusted = alloc_extend_write(t2, *args, backend=backend, extend_num_tokens=9, validate=False)
    assert trusted.out_cache_loc.tolist() == checked.out_cache_loc.tolist() == [41, 42, 43, 4, 5, 6, 8, 9, 10]
    assert torch.equal(t1, t2)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_plan_built_ahead_gives_the_computed_plans_slots_and_rows(page_size):
    gen = torch.Generator().manual_seed(11 + page_size)
    for bs in (1, 2, 9):
        case = random_extend_case(gen, bs, page_size, max_prefix_len=40, max_extend_len=30, device=DEVICE)
        rows = torch.randperm(bs + 2, generator=gen)[:bs].tolist()
        plan = extend_host_plan(case.prefix_lens.cpu(), case.seq_lens.cpu(), case.prefix_slots, page_size)
        assert plan[2 * bs : 3 * bs].tolist() == [0] * bs  # the rows are written at the launch
        ahead = lambda *a: alloc_extend_write_triton(*a, host_plan=plan)  # noqa: E731
        got, t_got = write_case(case, rows, ahead)
        ref, t_ref = write_case(case, rows, alloc_extend_write_torch)
        assert torch.equal(got.out_cache_loc, ref.out_cache_loc) and torch.equal(t_got, t_ref)
        assert got.req_pool_indices.tolist() == rows and torch.equal(got.seq_lens.cpu(), case.seq_lens.cpu())
        assert plan[2 * bs : 3 * bs].tolist() == [0] * bs  # copied, never written into


def test_a_plan_of_other_lengths_is_refused_when_validating():
    prefixes = [torch.tensor([20, 21, 22, 23, 40], device=DEVICE), torch.empty(0, dtype=torch.int64, device=DEVICE)]
    free = torch.arange(1, 9, device=DEVICE)
    other = extend_host_plan(cpu([5, 0]), cpu([11, 4]), prefixes, 4)
    with pytest.raises(ValueError, match="extend_host_plan"):
        alloc_extend_write_triton(table(2, 12), [0, 1], cpu([5, 0]), cpu([11, 3]), prefixes, free, 4, host_plan=other)
    with pytest.raises(ValueError, match="entries"):
        alloc_extend_write_triton(table(2, 12), [0, 1], cpu([5, 0]), cpu([11, 3]), prefixes, free, 4,
                                  host_plan=other[:6])


# ----------------------------------------------------------------------------- Launcher


def _param(name, constexpr=False, dns=True, dnsa=True):
    return SimpleNamespace(name=name, is_constexpr=constexpr, do_not_specialize=dns,
                           do_not_specialize_on_alignment=dnsa)


def test_launcher_goes_direct_only_for_unspecialised_kernels():
    free = SimpleNamespace(params=[_param("x"), _param("n"), _param("B", constexpr=True)])
    assert _unspecialised(free)
    aligned = SimpleNamespace(params=[_param("x", dnsa=False), _param("B", constexpr=True)])
    assert not _unspecialised(aligned)
    valued = SimpleNamespace(params=[_param("n", dns=False)])
    assert not _unspecialised(valued)
    assert not _unspecialised(SimpleNamespace())  # no parameter metadata: keep to the JIT


def test_launcher_key_covers_what_the_binary_depends_on():
    launcher = Launcher.__new__(Launcher)
    launcher._constexpr = [False, False, True]
    launcher._constexprs = (2,)
    x32 = torch.zeros(2, dtype=torch.int32)
    x64 = torch.zeros(2, dtype=torch.int64)
    launcher._classify((x64, 5, 16))
    assert launcher._tensors == (0,) and launcher._ints == (1,)
    assert launcher._key((x64, 5, 16)) == launcher._key((x64.clone(), 7, 16))
    assert launcher._key((x64, 5, 16)) != launcher._key((x32, 5, 16))  # dtype
    assert launcher._key((x64, 5, 16)) != launcher._key((x64, 5, 32))  # constexpr value
    assert launcher._key((x64, 5, 16)) != launcher._key((x64, 2**40, 16))  # int width
    with pytest.raises(AttributeError):  # a changed kind of argument: the call goes to the JIT
        launcher._key((5, 5, 16))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter only runs without CUDA")
def test_launcher_under_the_interpreter_calls_the_jit():
    from memcli.kernels.alloc import _alloc_extend_write_launch

    assert not _alloc_extend_write_launch.direct


@pytest.mark.gpu
def test_gpu_direct_launches_match_reference():
    from memcli.kernels.alloc import _alloc_extend_write_launch

    gen = torch.Generator().manual_seed(5)
    for page_size in (1, 16, 64):
        for bs in (1, 33, 256, 7, 600):  # repeated keys: every call after the first launches directly
            case = random_extend_case(gen, bs, page_size, max_prefix_len=1500, max_extend_len=600, device=DEVICE)
            rows = torch.randperm(bs + 2, generator=gen)[:bs].tolist()
            kernel, t_kernel = write_case(case, rows, alloc_extend_write_triton)
            ref, t_ref = write_case(case, rows, alloc_extend_write_torch)
            assert torch.equal(kernel.out_cache_loc, ref.out_cache_loc) and torch.equal(t_kernel, t_ref)
    assert _alloc_extend_write_launch.direct


# ----------------------------------------------------------------------------- free list as a ring


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_ops_read_the_free_list_as_a_ring(backend):
    from memcli.kernels import alloc_decode_write

    ring = torch.tensor([11, 12, 13, 14, 15, 16], device=DEVICE)  # free list from index 4: 15, 16, 11, 12
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    t = table(2, 8)
    got = alloc_extend_write(t, [0], cpu([0]), cpu([3]), [empty], ring, 1, backend=backend, free_start=4, num_free=4)
    assert got.out_cache_loc.tolist() == [15, 16, 11] == t[0, :3].tolist()
    short = alloc_extend_write(t, [1], cpu([0]), cpu([3]), [empty], ring, 1, backend=backend, free_start=4,
                               num_free=2)
    assert short.out_cache_loc.tolist() == [15, 16, -1]  # past num_free: -1, nothing else read
    paged = alloc_extend_write(t, [1], cpu([0]), cpu([5]), [empty], ring, 2, backend=backend, free_start=5,
                               num_free=3)
    assert paged.out_cache_loc.tolist() == [32, 33, 22, 23, 24]  # pages 16, 11, 12
    t2 = table(2, 8)
    out = alloc_decode_write(torch.tensor([0, 2], device=DEVICE), torch.tensor([1, 0], device=DEVICE), t2, ring, 2,
                             backend=backend, free_start=5, num_free=2)
    assert out.tolist() == [32, 22] and t2[1, 0] == 32 and t2[0, 2] == 22
    out = alloc_decode_write(torch.tensor([3, 4], device=DEVICE), torch.tensor([0, 1], device=DEVICE), t2, ring, 1,
                             backend=backend, free_start=5, num_free=3)
    assert out.tolist() == [16, 11]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_arguments_out_of_range_are_rejected(backend):
    from memcli.kernels import alloc_decode_write

    ring = torch.arange(1, 5, device=DEVICE)
    t = table(1, 4)
    one = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit a free list of 4 entries"):
        alloc_decode_write(one, one, t, ring, 1, backend=backend, free_start=5)
    # A ring starting at its end with nothing in it: an allocator whose stack is empty.
    assert alloc_decode_write(one + 1, one, t, ring, 4, backend=backend, free_start=4, num_free=0).tolist() == [
        int(t[0, 0]) + 1]
    with pytest.raises(ValueError, match="do not fit"):
        alloc_extend_write(t, [0], cpu([0]), cpu([1]), [one[:0]], ring, 1, backend=backend, num_free=5)
    with pytest.raises(ValueError, match="free_start must be a non-negative int"):
        alloc_decode_write(one, one, t, ring, 1, backend=backend, free_start=-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_page_size_one_edges(backend):
    """An empty batch; one request whose prefix is handed through as it is; and a free list
    shorter than the batch's new tokens (the tokens past it get slot -1, unvalidated)."""
    t = table(2, 6)
    empty = alloc_extend_write(t, [], cpu([]), cpu([]), [], torch.tensor([5], device=DEVICE), 1, backend=backend)
    assert empty.out_cache_loc.numel() == 0
    prefix = torch.tensor([21, 22], device=DEVICE)
    got = alloc_extend_write(t, [1], cpu([2]), cpu([4]), [prefix], torch.tensor([7, 8], device=DEVICE), 1,
                             backend=backend)
    assert got.out_cache_loc.tolist() == [7, 8] and t[1, :4].tolist() == [21, 22, 7, 8]
    fn = alloc_extend_write_triton if backend == "triton" else alloc_extend_write_torch
    short = fn(table(1, 6), [0], cpu([0]), cpu([3]), [torch.empty(0, dtype=torch.int64, device=DEVICE)],
               torch.tensor([4, 5, 6], device=DEVICE), 1, validate=False, num_free=2)
    assert short.out_cache_loc.tolist() == [4, 5, -1]


# ----------------------------------------------------------------------------- the plan's host arena


def test_plan_arena_carves_segments_and_grows():
    from memcli.kernels.alloc import PlanArena

    arena = PlanArena(segment=8)
    cpu_device = torch.device("cpu")
    a, addr_a = arena.take(6, cpu_device)
    b, addr_b = arena.take(6, cpu_device)  # no room left in segment 0: segment 1
    assert addr_b - addr_a == 8 * 8
    a[:], b[:] = 1, 2
    assert a.tolist() == [1] * 6 and b.tolist() == [2] * 6  # distinct memory
    for _ in range(PlanArena.SEGMENTS - 1):
        c, addr_c = arena.take(6, cpu_device)
    assert addr_c == addr_a  # the segments are reused in turn
    big, addr_big = arena.take(20, cpu_device)  # larger than a segment: a new arena
    assert big.shape == (20,) and arena.take(20, cpu_device)[1] - addr_big == 8 * 20


@pytest.mark.gpu
def test_gpu_back_to_back_extends_read_their_own_plans(monkeypatch):
    """Many extends queued behind a busy stream, more plans than the arena's segments hold:
    every launch reads its own plan (a reused segment waits for its event)."""
    from memcli.kernels import alloc as alloc_module

    monkeypatch.setattr(alloc_module, "_plan_arena", alloc_module.PlanArena(segment=64))
    gen = torch.Generator().manual_seed(9)
    cases = [(random_extend_case(gen, bs, ps, max_prefix_len=300, max_extend_len=200, device=DEVICE), ps)
             for bs, ps in [(1, 1), (9, 16), (3, 1), (10, 64), (2, 16)] * 12]
    # Lengths on the host and tables made first: nothing below synchronises until the checks.
    inputs = [(table(case.prefix_lens.numel() + 2, int(case.seq_lens.max()) + 3), case.prefix_lens.cpu(),
               case.seq_lens.cpu()) for case, _ in cases]
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the launches queue behind a spin
    kernels = []
    for (case, ps), (t, pre, seq) in zip(cases, inputs):
        rows = list(range(pre.numel()))
        kernels.append((alloc_extend_write_triton(t, rows, pre, seq, case.prefix_slots, case.free_pages, ps,
                                                  validate=False), t))
    for (case, _), (kernel, t_kernel) in zip(cases, kernels):
        ref, t_ref = write_case(case, list(range(case.prefix_lens.numel())), alloc_extend_write_torch)
        assert torch.equal(kernel.out_cache_loc, ref.out_cache_loc) and torch.equal(t_kernel, t_ref)
        assert torch.equal(kernel.seq_lens, ref.seq_lens) and torch.equal(kernel.prefix_lens, ref.prefix_lens)
        assert torch.equal(kernel.req_pool_indices, ref.req_pool_indices)


def test_next_power_of_2_is_tritons():
    sizes = [*range(0, 2100), 2**20 - 1, 2**20, 2**20 + 1, 3 * 2**31]
    assert [next_power_of_2(n) for n in sizes] == [triton.next_power_of_2(n) for n in sizes]


def test_launcher_key_of_several_tensors_and_no_int():
    launcher = Launcher.__new__(Launcher)
    launcher._constexpr = [False, False, True]
    launcher._constexprs = (2,)
    x32 = torch.zeros(2, dtype=torch.int32)
    x64 = torch.zeros(2, dtype=torch.int64)
    launcher._classify((x64, x32, 4))
    assert launcher._tensors == (0, 1) and launcher._ints == ()
    assert launcher._key((x64, x32, 4)) == (torch.int64, torch.int32, 4)
    assert launcher._key((x32, x32, 4)) != launcher._key((x64, x32, 4))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_extend_from_an_argument_block_gives_the_launchs_slots_and_rows(page_size):
    """`alloc_extend_write_planned` (every per-call value read from a host block, a grid of
    the batch's power of two or more, as a captured graph replays it) against the torch
    reference; programs past the batch size write nothing, and program 0 marks the call."""
    from memcli.kernels import alloc_extend_write_planned, extend_args_entries, extend_views, fill_extend_args
    gen = torch.Generator().manual_seed(page_size)
    pinned = DEVICE.type == "cuda"
    for bs, grid in ((1, 1), (3, 4), (5, 16)):
        case = random_extend_case(gen, bs, page_size, max_prefix_len=40, max_extend_len=30, device=DEVICE)
        rows = torch.randperm(bs + 2, generator=gen)[:bs].tolist()
        block = torch.full((extend_args_entries(grid) + 1,), -9, dtype=torch.int64, pin_memory=pinned)
        t_got = table(max(rows) + 3, int(case.seq_lens.max()) + 3)  # the shape `write_case` makes
        n = case.extend_num_tokens
        out = torch.full((3 * bs + n + 5,), -3, dtype=torch.int64, device=DEVICE)  # more than it needs
        plan = extend_host_plan(case.prefix_lens.cpu(), case.seq_lens.cpu(), case.prefix_slots, page_size) \
            if bs == 3 else None  # a plan built ahead, or computed
        fill_extend_args(block.numpy(), grid, rows, case.prefix_lens.cpu(), case.seq_lens.cpu(), case.prefix_slots,
                         page_size, out, n, 0, case.free_pages.shape[0], 41, plan)
        alloc_extend_write_planned(block.data_ptr(), block.data_ptr() + 8 * (block.shape[0] - 1), t_got,
                                   case.free_pages, page_size, grid)
        if pinned:
            torch.cuda.synchronize()
        assert out[3 * bs + n :].tolist() == [-3] * 5  # nothing written past the batch's entries
        got = extend_views(out, bs, n)
        ref, t_ref = write_case(case, rows, alloc_extend_write_torch, spare_rows=2)
        assert torch.equal(got.out_cache_loc, ref.out_cache_loc) and torch.equal(t_got, t_ref)
        assert got.req_pool_indices.tolist() == rows
        assert torch.equal(got.prefix_lens.cpu(), case.prefix_lens.cpu())
        assert torch.equal(got.seq_lens.cpu(), case.seq_lens.cpu())
        assert int(block[-1]) == 41


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_arguments_of_a_plan_built_ahead_are_the_general_fill(page_size):
    """`fill_extend_args_ahead` (header word by word, the plan built ahead copied, then the
    rows) writes the block `fill_extend_args` writes, for grids equal to and wider than the
    batch, at a block's offset, and leaves the words around it alone."""
    from memcli.kernels import extend_args_entries, fill_extend_args, fill_extend_args_ahead
    gen = torch.Generator().manual_seed(100 + page_size)
    for bs, grid in ((1, 1), (1, 2), (3, 3), (3, 4), (8, 8)):
        case = random_extend_case(gen, bs, page_size, max_prefix_len=40, max_extend_len=30, device=DEVICE)
        pre, seq = case.prefix_lens.cpu(), case.seq_lens.cpu()
        plan = extend_host_plan(pre, seq, case.prefix_slots, page_size)
        n, entries = case.extend_num_tokens, extend_args_entries(grid)
        rows = torch.randperm(bs + 5, generator=gen)[:bs].tolist()
        out = torch.empty(3 * bs + n, dtype=torch.int64, device=DEVICE)
        want = np.full(3 * entries, -7, dtype=np.int64)
        fill_extend_args(want[entries : 2 * entries], grid, rows, pre, seq, case.prefix_slots, page_size, out, n,
                         11, 97, 1234, plan)
        got = np.full(3 * entries, -7, dtype=np.int64)
        fill_extend_args_ahead(got, memoryview(got), entries, grid, rows, plan, out.data_ptr(), n, 11, 97, 1234)
        assert got[entries : entries + 6].tolist() == [bs, 11, 97, out.data_ptr(), n, 1234]
        assert got.tolist() == want.tolist(), (bs, grid)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_cpu_path_equals_the_device_path(page_size):
    # On a CPU the reference writes each row from its own prefix; the device path joins the
    # prefixes first. Both run on CPU tensors here, from mid-ring starts and short free lists.
    from memcli.kernels.alloc import _alloc_extend_write_cpu, _alloc_extend_write_device

    gen = torch.Generator().manual_seed(900 + page_size)
    for bs in (1, 2, 5, 11):
        case = random_extend_case(gen, bs, page_size, max_prefix_len=50, max_extend_len=50)
        rows = torch.randperm(bs + 3, generator=gen)[:bs].tolist()
        free = case.free_pages
        for start, count in ((0, free.shape[0]), (3, free.shape[0] - 3), (free.shape[0] - 2, free.shape[0])):
            results = []
            for fn in (_alloc_extend_write_cpu, _alloc_extend_write_device):
                t = torch.full((bs + 3, int(case.seq_lens.max()) + 2), SENTINEL, dtype=torch.int32)
                n = int(case.seq_lens.sum() - case.prefix_lens.sum())
                results.append((fn(t, rows, case.prefix_lens, case.seq_lens, case.prefix_slots, free, page_size, n,
                                   start, count), t))
            (a, ta), (b, tb) = results
            assert torch.equal(a.out_cache_loc, b.out_cache_loc) and torch.equal(ta, tb)
            assert a.req_pool_indices.tolist() == b.req_pool_indices.tolist() == rows
            assert torch.equal(a.prefix_lens, b.prefix_lens) and torch.equal(a.seq_lens, b.seq_lens)
