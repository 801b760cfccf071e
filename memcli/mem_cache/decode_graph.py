"""The decode memory path as one CUDA-graph replay per step.

A decode step's memory path is tiny on the device (one slot per request, one `req_to_token`
column, the free list's head moved) and all host time: Python, argument binding, a launch,
an allocation for the output. `DecodeGraphs` captures the whole step once per batch size,
`kernels.alloc_decode_step` with static buffers, and replays it:

* inputs: the graph reads the lengths and request rows from its own buffers. The lengths
  are incremented on the device by the step itself, and the batch keeps them as its
  `seq_lens`, so the next step finds them in place; a copy is made only when the batch
  hands in other tensors (a new batch, a filter, a merge, a restore);
* free list: its head and length live on the device (`state`, one packed int64) and the
  step advances them; the allocator keeps its host copy for the capacity check (the step's
  page count is known on the host before the replay) and moves it before the replay, so
  nothing is left to do on the host once the replay is launched. When an extend or a free
  moved the head, one fill sets the device copy before the next replay; a restore (`place`)
  sets it at once, so the step after it is one launch, as in a steady decode loop;
* output: the slots land in a static buffer, valid until the next step of that batch size,
  handed back as one `DecodeAllocation` built at the capture.

So a steady decode step is one graph launch. Replays give exactly the slots of the eager
path (tested on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from memcli import kernels
from memcli.mem_cache.allocator import DecodeAllocation

# Graphs kept at once: one per batch size seen, each a few small buffers and one tiny graph,
# so every batch size a scheduler can run (its request rows) fits; beyond this the oldest goes.
MAX_GRAPHS = 1024


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    seq: torch.Tensor  # lengths before the step; incremented in place by the replay
    rows: torch.Tensor
    out: torch.Tensor
    rows_source: Optional[torch.Tensor] = None  # the tensor `rows` was last copied from
    rows_version: int = -1

    def __post_init__(self):
        # The step's hand-off: its buffers are static, so it is the same object every step.
        self.result = DecodeAllocation(self.out, self.seq)


class DecodeGraphs:
    """The captured decode steps of one allocator over one `req_to_token` table."""

    def __init__(self, free_pages: torch.Tensor, req_to_token: torch.Tensor, page_size: int, ring: bool):
        self.free_pages = free_pages
        self.req_to_token = req_to_token
        self.page_size = page_size
        self.ring = ring
        self.state = torch.zeros(1, dtype=torch.int64, device=free_pages.device)
        self._on_device: Optional[tuple[int, int]] = None  # (head, length) the device state holds
        self._graphs: dict[int, _Graph] = {}
        self.captures = 0

    def step(self, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, before: tuple[int, int],
             after: tuple[int, int]) -> DecodeAllocation:
        """Replay the step for this batch from the free list at `before` (head, length);
        returns the slots and the lengths after the step, in this batch size's buffers (valid
        until its next step). The caller checked the capacity and already moved its host copy
        of the free list to `after`, where the replay leaves the device's."""
        bs = seq_lens.numel()
        g = self._graphs.get(bs) or self._capture(bs)
        if seq_lens is not g.seq:
            g.seq.copy_(seq_lens)
        if req_pool_indices is not g.rows_source or req_pool_indices._version != g.rows_version:
            g.rows.copy_(req_pool_indices)
            g.rows_source, g.rows_version = req_pool_indices, req_pool_indices._version
        # `place(*before)` inline: the call alone is about 0.2 µs of a 1.7 µs host path.
        if self._on_device != before:
            self.state.fill_(kernels.pack_free_state(*before))
        self._on_device = after
        g.graph.replay()
        return g.result

    def place(self, head: int, num_free: int) -> None:
        """Make the device copy of the free list (`head`, `num_free`), unless it holds it."""
        if self._on_device != (head, num_free):
            self.state.fill_(kernels.pack_free_state(head, num_free))
            self._on_device = (head, num_free)

    def _capture(self, bs: int) -> _Graph:
        device = self.free_pages.device
        seq = torch.zeros(bs, dtype=torch.int64, device=device)
        rows = torch.zeros(bs, dtype=torch.int64, device=device)
        out = torch.empty(bs, dtype=torch.int64, device=device)
        self._compile(bs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kernels.alloc_decode_step(seq, rows, self.req_to_token, self.free_pages, self.state, self.page_size,
                                      self.ring, out=out, backend="triton", validate=False)
        if len(self._graphs) >= MAX_GRAPHS:
            self._graphs.pop(next(iter(self._graphs)))
        g = self._graphs[bs] = _Graph(graph, seq, rows, out)
        self.captures += 1
        return g

    def _compile(self, bs: int) -> None:
        """Compile the kernel before the capture, on scratch buffers (a launch writes its
        inputs): an empty free list, so no page is read, and a scratch table row."""
        device = self.free_pages.device
        scratch = torch.zeros((1, 2), dtype=torch.int32, device=device)
        kernels.alloc_decode_step(torch.zeros(bs, dtype=torch.int64, device=device),
                                  torch.zeros(bs, dtype=torch.int64, device=device), scratch, self.free_pages,
                                  torch.zeros(1, dtype=torch.int64, device=device), self.page_size, self.ring,
                                  backend="triton", validate=False)
        torch.cuda.synchronize(device)
