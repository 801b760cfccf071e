"""GPU self-check: the Triton ops against their torch references over a sweep of sizes
(``alloc_decode_write``, ``alloc_extend_write``, ``store_kv``).

Run ``python -m memcli.kernels.selfcheck`` on a CUDA host. Prints Triton's start-up time (the
first launch of a one-line kernel), then one line per op: PASS or FAIL, the number of cases,
the wall time of the first Triton call per compile key (page size or dtype; it includes
compilation unless Triton's on-disk cache already held the binary; the torch reference runs
first on the same inputs, so CUDA start-up is not counted), and how many binaries the JIT
cache holds afterwards (one per page size for the allocation kernels). Exits 0 when every op
matches, 1 on any mismatch, 2 without CUDA.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import triton
import triton.language as tl

from . import alloc, kv_store
from ._common import num_compiled_variants
from .cases import random_decode_case, random_extend_case

PAGE_SIZES = (1, 16, 64)
BATCH_SIZES = (1, 2, 3, 8, 31, 64, 129, 256)
MAX_LENS = (16, 300, 2048)
# The decode kernels walk the batch in blocks of 1024 requests; cross that boundary too.
DECODE_BATCH_SIZES = BATCH_SIZES + (1024, 1025, 3000)
KV_SHAPES = ((1, 64, 1, 64, 1), (2, 1000, 2, 80, 300), (4, 4096, 8, 128, 2048))
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


class OpCheck:
    """Cases, mismatches and first-call times of one op."""

    def __init__(self, name: str, kernel, device: torch.device):
        self.name, self.kernel, self.device = name, kernel, device
        self.num_cases = 0
        self.failures: List[str] = []
        self.first_call_ms: Dict[str, float] = {}

    def call(self, key: str, fn: Callable):
        """Run the Triton side; time it (synchronized) if it is the first call for ``key``."""
        if key in self.first_call_ms:
            return fn()
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize(self.device)
        self.first_call_ms[key] = (time.perf_counter() - start) * 1e3
        return result

    def compare(self, label: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        self.num_cases += 1
        if not torch.equal(got, expected):
            self.failures.append(label)

    def line(self) -> str:
        status = "PASS"
        if self.failures:
            status = f"FAIL ({len(self.failures)}: {self.failures[0]}, ...)"
        times = " ".join(f"{k}={v:.0f}ms" for k, v in self.first_call_ms.items())
        variants = num_compiled_variants(self.kernel, self.device)
        return (f"{self.name:<20} {status:<6} cases={self.num_cases:<4} first_call[{times}] "
                f"compiled_variants={variants}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def check_alloc_decode_write(gen, device) -> OpCheck:
    check = OpCheck("alloc_decode_write", alloc._alloc_decode_write_kernel, device)
    for ps in PAGE_SIZES:
        for bs in DECODE_BATCH_SIZES:
            c = random_decode_case(gen, bs, ps, max_len=2048, device=device)
            table, ref_table = c.req_to_token.clone(), c.req_to_token.clone()
            head = (c.seq_lens_before, c.req_pool_indices)
            expected = alloc.alloc_decode_write_torch(*head, ref_table, c.free_pages, ps)
            got = check.call(
                f"ps{ps}", lambda: alloc.alloc_decode_write_triton(*head, table, c.free_pages, ps)
            )
            check.compare(f"ps={ps} bs={bs} out", got, expected)
            check.compare(f"ps={ps} bs={bs} req_to_token", table, ref_table)
    return check


def _as_ring(gen, free_pages: torch.Tensor, spare: int):
    """The free list stored as a ring of ``len + spare`` entries from a random start (the rest
    junk): (ring, free_start, num_free)."""
    n = free_pages.shape[0]
    cap = n + spare
    start = int(torch.randint(cap, (1,), generator=gen))
    ring = torch.full((cap,), -5, dtype=torch.int64, device=free_pages.device)
    ring[(start + torch.arange(n, device=free_pages.device)) % cap] = free_pages
    return ring, start, n


def check_alloc_extend_write(gen, device) -> OpCheck:
    check = OpCheck("alloc_extend_write", alloc._alloc_extend_write_kernel, device)
    for ps in PAGE_SIZES:
        for bs in BATCH_SIZES + (300, 600):  # past 256 requests the offsets take several blocks
            for max_len in MAX_LENS:
                c = random_extend_case(gen, bs, ps, max_len, max_len, device=device)
                rows = torch.randperm(bs + 7, generator=gen)[:bs].tolist()
                table = torch.full((bs + 7, 2 * max_len + 3), -7, dtype=torch.int32, device=device)
                ref_table = table.clone()
                ring, start, num_free = _as_ring(gen, c.free_pages, spare=5)
                head = (rows, c.prefix_lens.cpu(), c.seq_lens.cpu(), c.prefix_slots, ring, ps)
                ring_args = {"free_start": start, "num_free": num_free}
                expected = alloc.alloc_extend_write_torch(ref_table, *head, **ring_args)
                got = check.call(f"ps{ps}", lambda: alloc.alloc_extend_write_triton(table, *head, **ring_args))
                label = f"ps={ps} bs={bs} len<={max_len}"
                check.compare(label + " out", got.out_cache_loc, expected.out_cache_loc)
                check.compare(label + " req_to_token", table, ref_table)
    return check


def check_store_kv(gen, device) -> OpCheck:
    check = OpCheck("store_kv", kv_store._store_kv_kernel, device)
    for dtype in KV_DTYPES:
        for layers, rows, heads, head_dim, n in KV_SHAPES:
            def rand(*shape):
                return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

            k_buf, v_buf = rand(layers, rows, heads, head_dim), rand(layers, rows, heads, head_dim)
            k_ref, v_ref = k_buf.clone(), v_buf.clone()
            loc = torch.randperm(rows, generator=gen)[:n].to(device)
            k_new, v_new = rand(layers, n, heads, head_dim), rand(layers, n, heads, head_dim)
            key = str(dtype).removeprefix("torch.")
            kv_store.store_kv_torch(k_ref, v_ref, loc, k_new, v_new)
            check.call(key, lambda: kv_store.store_kv_triton(k_buf, v_buf, loc, k_new, v_new))
            label = f"{key} shape={(layers, rows, heads, head_dim)} n={n}"
            check.compare(label + " k", _bits(k_buf), _bits(k_ref))
            check.compare(label + " v", _bits(v_buf), _bits(v_ref))
    return check


CHECKS = (
    check_alloc_decode_write,
    check_alloc_extend_write,
    check_store_kv,
)


@triton.jit
def _touch_kernel(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def triton_start_up_ms(device: torch.device) -> float:
    """Wall time of the first launch of a one-line kernel: Triton's one-time start-up in this
    process (its driver and launcher modules, built and cached on disk when the cache is
    empty) plus that kernel's compile, so the ops' first calls below are their own compiles."""
    x = torch.zeros(1, dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    _touch_kernel[(1,)](x)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def main(argv: Optional[List[str]] = None) -> int:
    if not torch.cuda.is_available():
        print("error: the self-check needs a CUDA device", file=sys.stderr)
        print("hint: the CPU tests (pytest tests/kernels) cover the interpreter", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"triton start-up (first launch of a one-line kernel): {triton_start_up_ms(device):.0f}ms")
    ok = True
    for run_check in CHECKS:
        check = run_check(gen, device)
        print(check.line(), flush=True)
        ok = ok and not check.failures
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
