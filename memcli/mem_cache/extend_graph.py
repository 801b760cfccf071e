"""The extend (prefill) memory path as a CUDA-graph replay.

`allocator.alloc_extend_write` writes a batch's new slots and `req_to_token` rows with one
Triton launch, whose host work (Triton's launcher and the driver call: 13.5 to 24 µs on the
H200 host of docs/PERFORMANCE.md, against about 5 µs for a graph replay) was the largest part
of the prefill's memory path. `ExtendGraphs` captures `kernels.alloc_extend_write_planned`
once per grid (the batch size's power of two) and argument block, and replays it:

* arguments: everything that changes from one extend to the next (batch size, the free
  list's head and length, the output's address and length, the plan of lengths, rows,
  prefix addresses and offsets) is written into one of `SLOTS` blocks of pinned host memory,
  which the kernel reads; programs past the batch size do nothing;
* output: a device allocation of the caller's own per call, as on the launch path, so the
  slots and rows a batch keeps stay valid for as long as the batch holds them (the replay
  reads its address);
* reuse: the kernel's first program writes its call's number to one `started` word; a block
  is written again only once a later call has started (every launch before it on the stream
  is then done), and after a wait on the device otherwise, never with a wrong read;
* the same slots and rows as the launch (tested on a GPU; the kernel behind it is tested
  against the torch reference under the interpreter).
"""

from __future__ import annotations

import torch

from memcli import kernels
from memcli.kernels._common import next_power_of_2

# Argument blocks in turn: a block is reused after SLOTS - 1 other extends.
SLOTS = 4


class ExtendGraphs:
    """The captured extends of one allocator over one `req_to_token` table."""

    def __init__(self, free_pages: torch.Tensor, req_to_token: torch.Tensor, page_size: int):
        self.free_pages = free_pages
        self.req_to_token = req_to_token
        self.page_size = page_size
        self.device = free_pages.device
        # Every batch the table's rows allow fits a block.
        self.max_bs = next_power_of_2(max(1, req_to_token.shape[0]))
        self._stride = kernels.extend_args_entries(self.max_bs)
        self._args_tensor = torch.zeros(SLOTS * self._stride + 1, dtype=torch.int64, pin_memory=True)
        self._args = self._args_tensor.numpy()
        self._address = self._args_tensor.data_ptr()
        self._started = SLOTS * self._stride  # index of the `started` word
        self._last_call = [-1] * SLOTS  # the call each block last carried
        self._words = memoryview(self._args)  # the same memory: one word read or written costs least so
        # The grid of every batch size (its power of two) and the graphs by grid * SLOTS + block.
        self._grids = [0] + [next_power_of_2(bs) for bs in range(1, self.max_bs + 1)]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._slot = 0
        self._calls = 0
        self.captures = 0
        self.waits = 0

    def write(self, req_to_token: torch.Tensor, rows, prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor,
              prefixes, free_start: int, num_free: int, extend_num_tokens: int | None,
              host_plan=None) -> kernels.ExtendWrite | None:
        """`kernels.alloc_extend_write_triton` of the same arguments (unvalidated), as a replay;
        None (nothing done) for an empty batch, one larger than the table's rows, or another table."""
        bs = len(rows)
        if not bs or bs > self.max_bs or req_to_token is not self.req_to_token:
            return None
        if extend_num_tokens is None:
            extend_num_tokens = int(seq_lens_cpu.numpy().sum() - prefix_lens_cpu.numpy().sum())
        slot = self._slot
        self._slot = (slot + 1) % SLOTS
        words = self._words
        if words[self._started] <= self._last_call[slot]:
            self.waits += 1  # no later call has started: the block may not have been read yet
            torch.cuda.synchronize(self.device)
        call = self._calls = self._calls + 1
        self._last_call[slot] = call
        grid = self._grids[bs]
        graph = self._graphs.get(grid * SLOTS + slot) or self._capture(grid, slot)
        buffer = torch.empty(kernels.extend_output_entries(bs, extend_num_tokens), dtype=torch.int64,
                             device=self.device)
        base = slot * self._stride
        if host_plan is not None:
            kernels.fill_extend_args_ahead(self._args, words, base, grid, rows, host_plan, buffer.data_ptr(),
                                           extend_num_tokens, free_start, num_free, call)
        else:
            kernels.fill_extend_args(self._args[base : base + self._stride], grid, rows, prefix_lens_cpu,
                                     seq_lens_cpu, prefixes, self.page_size, buffer, extend_num_tokens, free_start,
                                     num_free, call, host_plan)
        graph.replay()
        return kernels.extend_views(buffer, bs, extend_num_tokens)

    def _launch(self, slot: int, grid: int) -> None:
        kernels.alloc_extend_write_planned(self._address + 8 * slot * self._stride, self._address + 8 * self._started,
                                           self.req_to_token, self.free_pages, self.page_size, grid)

    def _capture(self, grid: int, slot: int) -> torch.cuda.CUDAGraph:
        """The graphs of `grid` for every block at once (a warm-up meets each grid once), each
        compiled (and loaded) first on a block of no requests: that launch only writes
        `started`, with the last call's number (every call is done after the sync)."""
        torch.cuda.synchronize(self.device)
        for each in range(SLOTS):
            base = each * self._stride
            self._args[base : base + kernels.EXTEND_ARGS_HEADER] = 0
            self._args[base + kernels.EXTEND_ARG_CALL] = self._calls - 1
            self._launch(each, grid)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._launch(each, grid)
            self._graphs[grid * SLOTS + each] = graph
            self.captures += 1
        return self._graphs[grid * SLOTS + slot]


class BareExtend:
    """One batch's extend as a bare replay: the kernel of `ExtendGraphs`, captured once with
    the batch's argument block already written, replayed into a fresh output cut into the
    caller's views. No rows are taken, no counters move, no plan is copied: the floor of the
    extend's memory path on this device (the bench times it beside the path).

    Each replay writes what the batch's extend from `free_start` writes (the same slots into
    the same rows), and nothing of the allocator's host state. Its block is its own, so the
    replays of `ExtendGraphs` never wait on it."""

    def __init__(self, graphs: ExtendGraphs, rows: list[int], prefix_lens_cpu: torch.Tensor,
                 seq_lens_cpu: torch.Tensor, prefixes, free_start: int, num_free: int, extend_num_tokens: int,
                 host_plan=None):
        self.device = graphs.device
        self.bs, self.tokens = len(rows), extend_num_tokens
        self.size = kernels.extend_output_entries(self.bs, extend_num_tokens)
        grid = next_power_of_2(self.bs)
        entries = kernels.extend_args_entries(grid)
        self._args_tensor = torch.zeros(entries + 1, dtype=torch.int64, pin_memory=True)  # + `started`
        self._args = self._args_tensor.numpy()
        address = self._args_tensor.data_ptr()
        kernels.fill_extend_args(self._args[:entries], grid, rows, prefix_lens_cpu, seq_lens_cpu, prefixes,
                                 graphs.page_size, self._output(), extend_num_tokens, free_start, num_free, 1,
                                 host_plan)

        def launch() -> None:
            kernels.alloc_extend_write_planned(address, address + 8 * entries, graphs.req_to_token,
                                               graphs.free_pages, graphs.page_size, grid)

        torch.cuda.synchronize(self.device)
        launch()  # compiled and loaded before the capture
        torch.cuda.synchronize(self.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            launch()
        torch.cuda.synchronize(self.device)

    def _output(self) -> torch.Tensor:
        return torch.empty(self.size, dtype=torch.int64, device=self.device)

    def replay(self) -> kernels.ExtendWrite:
        """The extend into a fresh output and the caller's views of it. The output's address
        goes into the block before the replay; replays on one stream run in order, so an
        earlier one still queued writes into this output, never into freed memory."""
        out = self._output()
        self._args[kernels.EXTEND_ARG_OUT] = out.data_ptr()
        self.graph.replay()
        return kernels.extend_views(out, self.bs, self.tokens)
