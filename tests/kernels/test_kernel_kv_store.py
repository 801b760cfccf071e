"""store_kv: every layer's K/V rows land at loc, nothing else changes."""

import pytest
import torch

from memcli.kernels import store_kv, store_kv_torch, store_kv_triton

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _random(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)


def _case(gen, num_layers, rows, heads, head_dim, n, dtype):
    k_buffer = _random((num_layers, rows, heads, head_dim), dtype, gen)
    v_buffer = _random((num_layers, rows, heads, head_dim), dtype, gen)
    loc = torch.randperm(rows, generator=gen)[:n].to(DEVICE)
    k_new = _random((num_layers, n, heads, head_dim), dtype, gen)
    v_new = _random((num_layers, n, heads, head_dim), dtype, gen)
    return k_buffer, v_buffer, loc, k_new, v_new


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_store_kv_writes_exactly_loc_rows(dtype, backend):
    gen = torch.Generator().manual_seed(0)
    k_buffer, v_buffer, loc, k_new, v_new = _case(gen, 3, 12, 2, 4, 5, dtype)
    k_expected, v_expected = _bits(k_buffer).clone(), _bits(v_buffer).clone()
    k_expected[:, loc], v_expected[:, loc] = _bits(k_new), _bits(v_new)
    store_kv(k_buffer, v_buffer, loc, k_new, v_new, backend=backend)
    assert torch.equal(_bits(k_buffer), k_expected)
    assert torch.equal(_bits(v_buffer), v_expected)


@pytest.mark.parametrize("shape", [(1, 7, 1, 1, 1), (2, 40, 3, 24, 33), (4, 70, 8, 128, 9)])
def test_store_kv_kernel_matches_reference(shape):
    num_layers, rows, heads, head_dim, n = shape
    gen = torch.Generator().manual_seed(sum(shape))
    inputs = _case(gen, num_layers, rows, heads, head_dim, n, torch.bfloat16)
    k_ref, v_ref = inputs[0].clone(), inputs[1].clone()
    store_kv_torch(k_ref, v_ref, *inputs[2:])
    store_kv_triton(*inputs)
    assert torch.equal(inputs[0], k_ref)
    assert torch.equal(inputs[1], v_ref)


def test_store_kv_strided_views():
    # Layer-major views into larger tensors, and K/V new rows that are slices of a fused QKV.
    gen = torch.Generator().manual_seed(3)
    kv = _random((2, 3, 10, 2, 8), torch.float32, gen)
    k_buffer, v_buffer = kv[0], kv[1]
    qkv = _random((3, 4, 3 * 16), torch.float32, gen)
    k_new = qkv[:, :, 16:32].unflatten(2, (2, 8))
    v_new = qkv[:, :, 32:].unflatten(2, (2, 8))
    loc = torch.tensor([9, 0, 4, 5], device=DEVICE)
    expected = kv.clone()
    expected[0][:, loc], expected[1][:, loc] = k_new, v_new
    store_kv_triton(k_buffer, v_buffer, loc, k_new, v_new)
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_store_kv_no_tokens_is_a_no_op(backend):
    k_buffer = torch.zeros((2, 4, 1, 2), device=DEVICE)
    v_buffer = torch.zeros((2, 4, 1, 2), device=DEVICE)
    empty = torch.empty((2, 0, 1, 2), device=DEVICE)
    no_loc = torch.empty(0, dtype=torch.int64, device=DEVICE)
    store_kv(k_buffer, v_buffer, no_loc, empty, empty, backend=backend)
    assert not k_buffer.any() and not v_buffer.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_store_kv_large(dtype):
    gen = torch.Generator().manual_seed(1)
    inputs = _case(gen, 4, 5000, 8, 128, 2048, dtype)
    k_ref, v_ref = inputs[0].clone(), inputs[1].clone()
    store_kv_torch(k_ref, v_ref, *inputs[2:])
    store_kv_triton(*inputs)
    assert torch.equal(_bits(inputs[0]), _bits(k_ref))
    assert torch.equal(_bits(inputs[1]), _bits(v_ref))
