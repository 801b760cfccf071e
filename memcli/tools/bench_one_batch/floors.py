"""The floor of the prefill's memory path on a GPU, timed beside it.

The launch floor (`rounds.GraphFloor`, one tiny kernel's graph) is the floor of any path that
launches work. A prefill's memory path does more than any launch must: its kernel reads the
batch's plan and the free list and writes every new slot and row (device time), and a caller
gets device tensors back (an allocation and its views). `ExtendFloor` is that path with
nothing of the memory manager left: the same kernel, captured once for the batch with its
argument block already written, replayed into a fresh output cut into the caller's views.
No rows are taken, no counters or checks run, no plan is copied. What the prefill path
measures above it is the manager's own work.
"""

from __future__ import annotations

import torch

from memcli import kernels
from memcli.kernels._common import next_power_of_2


class ExtendFloor:
    """One batch's extend as a bare graph replay on an allocator with extend graphs.

    Built from the state before the batch's extend (`free_head`, the rows the extend takes):
    each replay writes what the batch's extend writes (the same slots, from the same head,
    into the same rows), so timing it in turn with the prefill leaves the table as the
    prefill's own calls leave it. The allocator's host state is not touched."""

    def __init__(self, allocator, plan, rows: list[int]):
        graphs = allocator.extend_graphs
        self.device = graphs.device
        self.bs, self.tokens = len(rows), plan.extend_num_tokens
        self.size = kernels.extend_output_entries(self.bs, self.tokens)
        grid = next_power_of_2(self.bs)
        entries = kernels.extend_args_entries(grid)
        self._args_tensor = torch.zeros(entries + 1, dtype=torch.int64, pin_memory=True)  # + `started`
        self._args = self._args_tensor.numpy()
        address = self._args_tensor.data_ptr()
        kernels.fill_extend_args(self._args[:entries], grid, rows, plan.prefix_lens_cpu, plan.seq_lens_cpu,
                                 plan.prefix_tensors, graphs.page_size, self._output(), self.tokens,
                                 allocator.free_head, plan.num_pages, 1, plan.host_plan)

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
        """The extend into a fresh output (its address written into the block, which every
        replay on this stream reads in order), and the caller's views of it."""
        out = self._output()
        self._args[kernels.EXTEND_ARG_OUT] = out.data_ptr()
        self.graph.replay()
        return kernels.extend_views(out, self.bs, self.tokens)


def extend_floor_for(stack, plan, rows: list[int]):
    """An `ExtendFloor` where the stack's extend is a graph replay (CUDA, triton backend,
    `runtime.decode_graph`) and the batch fits one; else None."""
    graphs = getattr(stack.allocator, "extend_graphs", None)
    if graphs is None or not rows or len(rows) > graphs.max_bs:
        return None
    return ExtendFloor(stack.allocator, plan, rows)

