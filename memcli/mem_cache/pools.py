"""The request-to-token table and the KV buffers.

`ReqToTokenPool` maps a request row and a position to a KV slot:

    req_to_token[row, 0:prefix_len)         slots of the cached prefix (owned by the tree)
    req_to_token[row, prefix_len:seq_len)   slots the request allocated itself

`KVPool` holds K and V of every slot for every layer; slot 0 (page 0) is padding.
"""

from __future__ import annotations

import mmap
from typing import Iterable, Optional, Protocol

import numpy as np
import torch

from memcli.check_result import CheckResult, IntegrityReport

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


class RowObserver(Protocol):
    """Told when request rows go back to the pool (the ownership ledger, while checking)."""

    def rows_released(self, rows: Iterable[int]) -> None:
        """`rows` return to the free rows; may raise (a row that still owns pages: a lost page),
        before the pool changed anything."""


def _zeroed_table(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 table. On a CPU from pages the OS hands out already zeroed
    (`_zeroed_host`), so that only the rows' used columns are ever touched: the replay table is
    512 rows of 131,072 columns (256 MiB), of which requests use a tenth, and writing zeros over
    all of it cost more than a whole short replay."""
    if torch.device(device).type == "cpu":
        return torch.from_numpy(_zeroed_host(rows, cols))
    return torch.zeros((rows, cols), dtype=torch.int32, device=device)


def _zeroed_host(rows: int, cols: int) -> np.ndarray:
    """A zeroed int32 array of `rows` x `cols` in a private anonymous mapping (zero pages on
    first touch), advised off transparent huge pages where the OS has them: a row is written
    only up to its longest request, and where huge pages are on, the first write into each
    2 MiB of the table zeroes all of it (0.3 to 7 ms on this project's CPU, against 2 us for a
    4 KiB page). Elsewhere, or when the mapping is refused, numpy's `zeros` (calloc)."""
    nbytes = rows * cols * 4
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if nbytes == 0 or advice is None:
        return np.zeros((rows, cols), dtype=np.int32)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return np.zeros((rows, cols), dtype=np.int32)
    try:
        buf.madvise(advice)
    except OSError:  # a kernel without the advice: huge pages or not, the table is the same
        pass
    return np.frombuffer(buf, dtype=np.int32).reshape(rows, cols)  # the array keeps the mapping alive


class ReqToTokenPool:
    """`size` request rows of `cols` int32 slot ids on `device`; rows are handed out FIFO from
    row 0, or (`row_order="lifo_row0"`, SGLang 0.5.23) from the tail of the free list, row 0 kept
    as padding."""

    # The observer of rows given back: the ownership ledger, while checking incrementally (`integrity.track`).
    ledger: Optional[RowObserver] = None

    def __init__(self, size: int, cols: int, device: torch.device, row_order: str = "fifo"):
        if row_order not in ("fifo", "lifo_row0"):
            raise ValueError(f"row order {row_order!r}: use fifo or lifo_row0")
        self.size = size
        self.cols = cols
        self.device = device
        # lifo_row0 (SGLang 0.5.23): row 0 is padding, rows 1..size are handed out from the tail.
        self.first = 1 if row_order == "lifo_row0" else 0
        self.req_to_token = _zeroed_table(size + self.first, cols, device)
        self.clear()

    def clear(self) -> None:
        self.free_slots: list[int] = list(range(self.first, self.size + self.first))
        self._in_use = [False] * (self.size + self.first)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` rows (the oldest free first, or the last `n` free under lifo_row0); None when fewer are free."""
        if n > len(self.free_slots):
            return None
        if self.first:  # the tail of the free list (0.5.23's alloc_rows)
            cut = len(self.free_slots) - n
            rows = self.free_slots[cut:]
            del self.free_slots[cut:]  # in place: no copy of the rows left
        else:
            rows = self.free_slots[:n]
            del self.free_slots[:n]
        for row in rows:
            self._in_use[row] = True
        return rows

    def free(self, row: int | list[int]) -> None:
        """Return rows; freeing a row that is not in use raises (double free) and frees none."""
        rows = [row] if isinstance(row, int) else list(row)
        seen: set[int] = set()
        for r in rows:
            if not self.first <= r < self.size + self.first or not self._in_use[r] or r in seen:
                raise ValueError(f"request row {r} freed twice or never allocated")
            seen.add(r)
        if self.ledger is not None:  # a row must own no page when it goes back (else a page is lost)
            self.ledger.rows_released(rows)
        for r in rows:
            self._in_use[r] = False
        self.free_slots.extend(rows)

    def free_range(self, first: int, n: int) -> None:
        """`free` of the `n` consecutive rows from `first` (checked as one slice, not row by row)."""
        end = first + n
        in_use = self._in_use
        if self.ledger is not None or first < self.first or end > self.size + self.first or not all(in_use[first:end]):
            self.free(list(range(first, end)))  # the observer, or the error naming the row
            return
        in_use[first:end] = [False] * n
        self.free_slots.extend(range(first, end))

    def rows_in_use(self) -> list[int]:
        return [r for r, used in enumerate(self._in_use) if used]

    def check_integrity(self) -> IntegrityReport:
        free = self.free_slots
        return IntegrityReport(
            "req_to_token_pool",
            [
                CheckResult("no duplicate free rows", len(set(free)) == len(free),
                            f"{len(free) - len(set(free))} duplicates"),
                CheckResult(
                    "free + in use == size",
                    len(free) + len(self.rows_in_use()) == self.size,
                    f"free {len(free)} + in use {len(self.rows_in_use())} vs size {self.size}",
                ),
            ],
        )


class KVPool:
    """K and V buffers of `size + page_size` rows per layer.

    Stored as two tensors `[num_layers, size + page_size, num_kv_heads, head_dim]` so that one
    kernel can write every layer. With `materialized=False` no buffer is allocated (indices-only
    mode for large runs on a CPU); `bytes_per_token` still reports the real footprint.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
        device: torch.device,
        materialized: bool = True,
    ):
        self.size = size
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = TORCH_DTYPES[dtype]
        self.device = device
        self.materialized = materialized
        self.rows = size + page_size
        if materialized:
            shape = (num_layers, self.rows, num_kv_heads, head_dim)
            self.k_buffer = torch.zeros(shape, dtype=self.dtype, device=device)
            self.v_buffer = torch.zeros(shape, dtype=self.dtype, device=device)
        else:
            self.k_buffer = self.v_buffer = None

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * itemsize
