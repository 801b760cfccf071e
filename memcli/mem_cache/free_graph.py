"""The free of whole request rows as a CUDA-graph replay, for frees one program takes.

`allocator.free_rows` frees the pages of consecutive rows with one Triton launch. On a GPU
host most of that call is the launch's host work (Triton's launcher and the driver call: 14
to 17 µs on the H200 host of docs/PERFORMANCE.md, against 5 µs for a graph replay).
`FreeRowsGraphs` captures `kernels.free_rows_planned` once per block size and argument block,
and replays it:

* arguments: the rows, pages and destination of a free are written into one of `SLOTS`
  blocks of pinned host memory (`kernels.FREE_ARGS` int64 each), which the kernel reads;
* reuse: the kernel writes the block's call number back once it has read the block; a block
  is written again only after that (a wait on the device otherwise, never a wrong read), so
  frees queued faster than the device runs them stay correct;
* the same pages in the same places of the free list as the launch (tested on a GPU); the
  allocator keeps its counters and picks the destination as before.
"""

from __future__ import annotations

import torch

from memcli import kernels

# Argument blocks in turn: a block is reused after SLOTS - 1 other frees.
SLOTS = 4


class FreeRowsGraphs:
    """The captured frees of rows of one allocator over one `req_to_token` table."""

    def __init__(self, free_pages: torch.Tensor, req_to_token: torch.Tensor, page_size: int):
        self.free_pages = free_pages
        self.req_to_token = req_to_token
        self.page_size = page_size
        self.device = free_pages.device
        self._args_tensor = torch.zeros(SLOTS * kernels.FREE_ARGS, dtype=torch.int64, pin_memory=True)
        self._args = self._args_tensor.numpy()
        self._address = self._args_tensor.data_ptr()
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._slot = 0
        self._calls = 0
        self.captures = 0
        self.waits = 0

    def free(self, req_to_token: torch.Tensor, row0: int, num_rows: int, length: int, dest: int) -> bool:
        """Write the pages of columns [0, length) of rows row0 .. row0 + num_rows - 1 into the
        free list from `dest`, as `kernels.free_rows_triton` does; False (nothing done) when
        one program does not take them or the table is not the captured one."""
        ps = self.page_size
        n = num_rows * ((length + ps - 1) // ps)
        block = kernels.free_rows_block(n, ps)
        if block is None or req_to_token is not self.req_to_token:
            return False
        slot = self._slot
        self._slot = (slot + 1) % SLOTS
        base = slot * kernels.FREE_ARGS
        args = self._args
        if args[base + kernels.FREE_ARG_DONE] != args[base + kernels.FREE_ARG_CALL]:
            self.waits += 1  # its last replay has not read the block yet
            torch.cuda.synchronize(self.device)
        self._calls += 1
        args[base : base + 5] = (row0, (length + ps - 1) // ps, n, dest, self._calls)
        graph = self._graphs.get((block, slot)) or self._capture(block, slot)
        graph.replay()
        return True

    def _capture(self, block: int, slot: int) -> torch.cuda.CUDAGraph:
        address = self._address + 8 * slot * kernels.FREE_ARGS
        # Compile (and load) the kernel first, on a block of no pages: it only marks the block read.
        base = slot * kernels.FREE_ARGS
        saved = self._args[base : base + kernels.FREE_ARGS].copy()
        self._args[base : base + kernels.FREE_ARGS] = 0
        kernels.free_rows_planned(address, self.req_to_token, self.free_pages, self.page_size, block)
        torch.cuda.synchronize(self.device)
        self._args[base : base + kernels.FREE_ARGS] = saved
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kernels.free_rows_planned(address, self.req_to_token, self.free_pages, self.page_size, block)
        self._graphs[(block, slot)] = graph
        self.captures += 1
        return graph
