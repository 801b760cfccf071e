"""Every launcher rejects bad inputs with a ValueError that names the problem, on both backends."""

import pytest
import torch

from memcli.kernels import alloc_decode_write, alloc_extend_write, store_kv
from memcli.kernels._common import check_triton_device

BACKENDS = ["triton", "torch"]
META = torch.device("meta")  # a second device that exists on every host


def i64(values):
    return torch.tensor(values, dtype=torch.int64)


def decode_write_args(**changes):
    args = dict(seq_lens_before=i64([2, 4]), req_pool_indices=i64([0, 1]),
                req_to_token=torch.zeros((2, 8), dtype=torch.int32), free_pages=i64([5, 6]),
                page_size=4)
    args.update(changes)
    return args


def kv_args(**changes):
    args = dict(k_buffer=torch.zeros((2, 6, 1, 4)), v_buffer=torch.zeros((2, 6, 1, 4)),
                loc=i64([1, 3]), k_new=torch.ones((2, 2, 1, 4)), v_new=torch.ones((2, 2, 1, 4)))
    args.update(changes)
    return args


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,message", [
    (dict(req_to_token=torch.zeros((2, 8), dtype=torch.int64)), "req_to_token must be torch.int32"),
    (dict(req_to_token=torch.zeros((2, 8), dtype=torch.int32).t()), "req_to_token rows"),
    (dict(req_pool_indices=i64([0])), "req_pool_indices must have length 2"),
    (dict(seq_lens_before=i64([2, 4]).to(META)), "seq_lens_before is on meta"),
    (dict(seq_lens_before=torch.tensor([2, 4], dtype=torch.int32)), "seq_lens_before must be torch.int64"),
    (dict(free_pages=i64([5, 6]).to(META)), "free_pages is on meta"),
    (dict(free_pages=i64([5, 0, 6])[::2]), "free_pages must be contiguous"),
    (dict(page_size=0), "page_size must be a positive int"),
    (dict(page_size=2.0), "page_size must be a positive int"),
])
def test_alloc_decode_write_rejects(change, message, backend):
    with pytest.raises(ValueError, match=message):
        alloc_decode_write(**decode_write_args(**change), backend=backend)


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
    (alloc_decode_write, decode_write_args()),
    (alloc_extend_write, dict(req_to_token=torch.zeros((1, 8), dtype=torch.int32), rows=[0],
                              prefix_lens_cpu=i64([0]), seq_lens_cpu=i64([3]), prefixes=[i64([])],
                              free_pages=i64([5]), page_size=4)),
    (store_kv, kv_args()),
])
def test_unknown_backend(op, args):
    with pytest.raises(ValueError, match="backend must be one of"):
        op(**args, backend="cuda")


def test_compiled_kernels_refuse_cpu_tensors():
    compiled_kernel = object()  # anything but the interpreter's function type
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        check_triton_device(torch.device("cpu"), compiled_kernel)
