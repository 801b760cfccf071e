"""The attention backend the reference runs: SGLang 0.5.5's default on the device, or the one
asked for; and, on CUDA, SGLang's Triton write paths against memcli's fused extend write."""

import pytest
import torch

from memcli.errors import MemcliError
from memcli.kernels import alloc_extend_write
from memcli.kernels.cases import random_extend_case
from memcli.reference.backends import FALLBACK, choose_backend, default_backend

CUDA = torch.cuda.is_available()


def test_default_backend_follows_sglangs_rule():
    assert default_backend("cpu") == "torch_native"
    assert default_backend("cuda", (9, 0), "12.4") == "fa3"  # H100 / H200
    assert default_backend("cuda", (9, 0), "13.0") == "fa3"
    assert default_backend("cuda", (9, 0), "12.1", flashinfer=False) == "triton"  # Hopper, CUDA too old
    assert default_backend("cuda", (8, 0), "12.4", flashinfer=True) == "flashinfer"  # A100
    assert default_backend("cuda", (10, 0), "12.8", flashinfer=False) == "triton"


def test_choose_backend_labels_and_refusals():
    cpu = choose_backend("cpu")
    assert cpu.name == FALLBACK and cpu.default and not cpu.triton_paths
    assert "default" in cpu.label
    amx = choose_backend("cpu", "intel_amx")
    assert not amx.default and not amx.triton_paths and "asked for" in amx.label
    with pytest.raises(MemcliError, match="needs CUDA"):
        choose_backend("cpu", "fa3")
    with pytest.raises(MemcliError, match="not an attention backend"):
        choose_backend("cuda", "fa9")
    if CUDA:
        fallback = choose_backend("cuda", FALLBACK)
        assert not fallback.default and "fallback path" in fallback.label
        assert choose_backend("cuda").triton_paths


def test_the_loader_sets_the_devices_default(ref):
    assert ref.attention_backend == default_backend(torch.device(ref.device).type)
    try:
        ref.use_attention_backend("intel_amx")
        assert ref.attention_backend == "intel_amx"
    finally:
        ref.use_attention_backend(default_backend(torch.device(ref.device).type))


def _memcli_write(case, rows, width):
    table = torch.full((max(rows) + 2, width), -7, dtype=torch.int32, device="cuda")
    written = alloc_extend_write(table, rows, case.prefix_lens.cpu(), case.seq_lens.cpu(), case.prefix_slots,
                                 case.free_pages, case.page_size, backend="triton")
    return written, table


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_sglangs_triton_write_matches_memclis_fused_write(ref, page_size):
    """write_req_to_token_pool_triton, given memcli's new slots, writes the rows memcli's
    alloc_extend_write wrote; get_last_loc_triton reads back each prefix's last slot."""
    common = ref.common
    gen = torch.Generator().manual_seed(40 + page_size)
    for bs in (1, 7, 64):
        case = random_extend_case(gen, bs, page_size, max_prefix_len=700, max_extend_len=600, device="cuda")
        rows = torch.randperm(bs + 3, generator=gen)[:bs].tolist()
        width = int(case.seq_lens.max()) + 2
        mine, table = _memcli_write(case, rows, width)
        theirs = torch.full_like(table, -7)
        rows_d = torch.tensor(rows, dtype=torch.int64, device="cuda")
        pointers = torch.tensor([p.data_ptr() for p in case.prefix_slots], dtype=torch.uint64, device="cuda")
        common.write_req_to_token_pool_triton[(bs,)](
            theirs, rows_d, pointers, case.prefix_lens, case.seq_lens, case.seq_lens - case.prefix_lens,
            mine.out_cache_loc, theirs.shape[1])
        assert torch.equal(theirs, table)
        last = common.get_last_loc_triton(theirs, rows_d, case.prefix_lens)
        assert torch.equal(last, case.last_loc)


@pytest.mark.gpu
def test_sglangs_write_cache_indices_takes_the_triton_path_on_the_default(ref, monkeypatch):
    """With the device's default backend, SGLang's write_cache_indices launches its Triton
    kernel (not the per-request loop), and writes what memcli writes."""
    common = ref.common
    assert choose_backend("cuda").triton_paths and ref.attention_backend == default_backend("cuda")
    launched = []
    kernel = common.write_req_to_token_pool_triton

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(common, "write_req_to_token_pool_triton", Spy())
    gen = torch.Generator().manual_seed(3)
    case = random_extend_case(gen, 5, 1, max_prefix_len=300, max_extend_len=300, device="cuda")
    rows = [4, 0, 2, 1, 3]
    mine, table = _memcli_write(case, rows, int(case.seq_lens.max()) + 2)
    pool = ref.ReqToTokenPool(6, table.shape[1], "cuda", enable_memory_saver=False)
    pool.req_to_token.fill_(-7)
    extend = case.seq_lens - case.prefix_lens
    rows_d = torch.tensor(rows, dtype=torch.int64, device="cuda")
    common.write_cache_indices(mine.out_cache_loc, rows_d, rows_d.cpu(), case.prefix_lens, case.prefix_lens.cpu(),
                               case.seq_lens, case.seq_lens.cpu(), extend, extend.cpu(), case.prefix_slots, pool)
    assert launched == [(5,)]
    assert torch.equal(pool.req_to_token[rows_d], table[rows_d])
