"""Every launcher rejects bad inputs with a ValueError that names the problem, on both backends."""

import pytest
import torch

from memcli.kernels import (
    alloc_decode,
    alloc_decode_write,
    alloc_extend,
    get_last_loc,
    store_kv,
    write_cache_indices,
)
from memcli.kernels._common import check_triton_device

BACKENDS = ["triton", "torch"]
META = torch.device("meta")  # a second device that exists on every host


def i64(values):
    return torch.tensor(values, dtype=torch.int64)


def extend_args(**changes):
    args = dict(prefix_lens=i64([0, 4]), seq_lens=i64([3, 6]), last_loc=i64([-1, 11]),
                free_pages=i64([5, 6]), page_size=4, extend_num_tokens=5)
    args.update(changes)
    return args


def decode_write_args(**changes):
    args = dict(seq_lens_before=i64([2, 4]), req_pool_indices=i64([0, 1]),
                req_to_token=torch.zeros((2, 8), dtype=torch.int32), free_pages=i64([5, 6]),
                page_size=4)
    args.update(changes)
    return args


def write_args(**changes):
    args = dict(req_to_token=torch.zeros((2, 8), dtype=torch.int32),
                req_pool_indices=i64([1]), prefix_lens=i64([2]), seq_lens=i64([3]),
                out_cache_loc=i64([9]), prefix_flat=i64([4, 5]))
    args.update(changes)
    return args


def kv_args(**changes):
    args = dict(k_buffer=torch.zeros((2, 6, 1, 4)), v_buffer=torch.zeros((2, 6, 1, 4)),
                loc=i64([1, 3]), k_new=torch.ones((2, 2, 1, 4)), v_new=torch.ones((2, 2, 1, 4)))
    args.update(changes)
    return args


ALLOC_EXTEND_BAD = [
    (dict(seq_lens=torch.tensor([3, 6], dtype=torch.int32)), "seq_lens must be torch.int64"),
    (dict(last_loc=i64([-1])), "last_loc must have length 2"),
    (dict(prefix_lens=i64([[0, 4]])), "prefix_lens must be 1-D"),
    (dict(free_pages=i64([5, 6]).to(META)), "free_pages is on meta"),
    (dict(free_pages=i64([5, 0, 6])[::2]), "free_pages must be contiguous"),
    (dict(page_size=0), "page_size must be a positive int"),
    (dict(extend_num_tokens=-1), "extend_num_tokens must be a non-negative int"),
    (dict(seq_lens=[3, 6]), "seq_lens must be a torch.Tensor"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,message", ALLOC_EXTEND_BAD)
def test_alloc_extend_rejects(change, message, backend):
    with pytest.raises(ValueError, match=message):
        alloc_extend(**extend_args(**change), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,message", [
    (dict(seq_lens=torch.tensor([7.0, 9.0])), "seq_lens must be torch.int64"),
    (dict(last_loc=i64([1, 2, 3])), "last_loc must have length 2"),
    (dict(free_pages=i64([1]).to(META)), "free_pages is on meta"),
    (dict(page_size=2.0), "page_size must be a positive int"),
])
def test_alloc_decode_rejects(change, message, backend):
    args = dict(seq_lens=i64([7, 9]), last_loc=i64([3, 4]), free_pages=i64([1]), page_size=4)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        alloc_decode(**args, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,message", [
    (dict(req_to_token=torch.zeros((2, 8), dtype=torch.int64)), "req_to_token must be torch.int32"),
    (dict(req_to_token=torch.zeros((2, 8), dtype=torch.int32).t()), "req_to_token rows"),
    (dict(req_pool_indices=i64([0])), "req_pool_indices must have length 2"),
    (dict(seq_lens_before=i64([2, 4]).to(META)), "seq_lens_before is on meta"),
])
def test_alloc_decode_write_rejects(change, message, backend):
    with pytest.raises(ValueError, match=message):
        alloc_decode_write(**decode_write_args(**change), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,message", [
    (dict(prefix_flat=torch.tensor([4, 5], dtype=torch.int32)), "prefix_flat must be torch.int64"),
    (dict(prefix_flat=i64([4, 0, 5])[::2]), "prefix_flat must be contiguous"),
    (dict(prefix_flat=i64([4, 5]).to(META)), "prefix_flat is on meta"),
    (dict(out_cache_loc=torch.tensor([9], dtype=torch.int32)), "out_cache_loc must be torch.int64"),
    (dict(seq_lens=i64([3, 3])), "seq_lens must have length 1"),
    (dict(req_to_token=torch.zeros(8, dtype=torch.int32)), "req_to_token must be 2-D"),
])
def test_write_cache_indices_rejects(change, message, backend):
    with pytest.raises(ValueError, match=message):
        write_cache_indices(**write_args(**change), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_get_last_loc_rejects(backend):
    table = torch.zeros((2, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="prefix_lens must have length 1"):
        get_last_loc(table, i64([0]), i64([1, 2]), backend=backend)
    with pytest.raises(ValueError, match="req_pool_indices must be torch.int64"):
        get_last_loc(table, torch.tensor([0], dtype=torch.int32), i64([1]), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,message", [
    (dict(k_new=torch.ones((2, 2, 1, 4), dtype=torch.bfloat16)), "k_new must be torch.float32"),
    (dict(v_buffer=torch.zeros((2, 7, 1, 4))), r"v_buffer must have shape \(2, 6, 1, 4\)"),
    (dict(k_new=torch.ones((2, 3, 1, 4))), r"k_new must have shape \(2, 2, 1, 4\)"),
    (dict(loc=torch.tensor([1, 3], dtype=torch.int32)), "loc must be torch.int64"),
    (dict(k_buffer=torch.zeros((2, 6, 4))), "k_buffer must be 4-D"),
    (dict(k_buffer=torch.zeros((2, 6, 1, 4), dtype=torch.int32)), "float dtype"),
    (dict(v_new=torch.ones((2, 2, 4, 1)).transpose(2, 3)), "v_new must be contiguous over"),
    (dict(loc=i64([1, 3]).to(META)), "loc is on meta"),
])
def test_store_kv_rejects(change, message, backend):
    with pytest.raises(ValueError, match=message):
        store_kv(**kv_args(**change), backend=backend)


@pytest.mark.parametrize("op,args", [
    (alloc_extend, extend_args()),
    (write_cache_indices, write_args()),
    (store_kv, kv_args()),
])
def test_unknown_backend(op, args):
    with pytest.raises(ValueError, match="backend must be one of"):
        op(**args, backend="cuda")


def test_compiled_kernels_refuse_cpu_tensors():
    compiled_kernel = object()  # anything but the interpreter's function type
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        check_triton_device(torch.device("cpu"), compiled_kernel)
