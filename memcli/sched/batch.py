"""ScheduleBatch: the requests of one forward step and their length tensors.

Memory is reached only through the memory manager (`memcli.mem_cache.manager`), by named
values: the batch asks for an `ExtendPlan`, hands it back to be served and keeps the
`ExtendAllocation`'s tensors (memory updates the requests' records); for a decode step it
counts the pages (`decode_pages_needed`, O(1)) and passes that number down.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import torch

from memcli.mem_cache import pages
from memcli.mem_cache.manager import ExtendPlan, MemoryManager, PagedRun, Release

_finished = attrgetter("finished")


def _decode_end(req) -> int:
    """`ScheduleBatch.decode_ends` of one request."""
    finish = req.max_new_tokens
    if 0 < req.eos_len < finish:
        finish = req.eos_len
    return req.input_len + finish - 1


def _present(steps: int, leave_at: np.ndarray, first: int, last: int) -> np.ndarray:
    """Per step `first`..`last` of a run (rows) and request (columns): is the request in that
    step's batch (it leaves at `leave_at`, 1-based; 0 or past `steps`: never)."""
    stays_until = np.where((leave_at == 0) | (leave_at > steps), steps + 1, leave_at)
    return np.arange(first, last + 1, dtype=np.int64)[:, None] < stays_until[None, :]


class ScheduleBatch:
    def __init__(self, reqs: list, memory: MemoryManager, enable_overlap: bool = False):
        self.reqs = list(reqs)
        self.memory = memory
        self.device = memory.device
        self.forward_mode = "idle"
        self.seq_lens_cpu = torch.empty(0, dtype=torch.int64)
        self.seq_lens = torch.empty(0, dtype=torch.int64, device=self.device)
        self.req_pool_indices = torch.empty(0, dtype=torch.int64, device=self.device)
        self.extend_plan: ExtendPlan | None = None  # of the last prepare_for_extend
        self.out_cache_loc: torch.Tensor | None = None
        self._page_hist: _PageHistogram | None = None
        self._len_sum: tuple[torch.Tensor, int] | None = None  # (lengths, their sum): see `seq_lens_sum`
        self._ends: tuple[list, int, np.ndarray] | None = None  # (reqs, their number, `decode_ends`)
        # SGLang's `enable_overlap`: the next decode's page estimate reads `req.seqlen`, whose
        # outputs lag one step behind the KV (see `estimated_decode_pages`).
        self.enable_overlap = enable_overlap

    def __len__(self) -> int:
        return len(self.reqs)

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def page_size(self) -> int:
        return self.memory.page_size

    @property
    def prefix_lens_cpu(self) -> torch.Tensor:
        """Prefix lengths of the last extend (empty before one)."""
        plan = self.extend_plan
        return plan.prefix_lens_cpu if plan is not None else torch.empty(0, dtype=torch.int64)

    @property
    def extend_num_tokens(self) -> int:
        """New tokens of the last extend (0 before one)."""
        return self.extend_plan.extend_num_tokens if self.extend_plan is not None else 0

    def prepare_for_extend(self) -> bool:
        """Plan the extend and have memory serve it (rows, KV slots, the requests' records);
        False, with nothing taken, when memory cannot."""
        self.forward_mode = "extend"
        plan = self.extend_plan = self.memory.plan_extend(self.reqs)
        self.seq_lens_cpu = plan.seq_lens_cpu
        alloc = self.memory.alloc_extend(plan, self.reqs)
        if alloc is None:
            return False
        self.out_cache_loc = alloc.out_cache_loc
        self.req_pool_indices = alloc.req_pool_indices
        self.seq_lens = alloc.seq_lens
        for req in self.reqs:
            req.is_retracted = False
        return True

    def prepare_for_decode(self) -> None:
        """Allocate one slot per request at column `seq_lens`, then increment `seq_lens`.
        Raises `OutOfMemoryError` when the step does not fit (`check_decode_mem` first)."""
        self.forward_mode = "decode"
        num_pages = self.decode_pages_needed(self.page_size)
        written = self.memory.alloc_decode(self.reqs, seq_lens=self.seq_lens, seq_lens_cpu=self.seq_lens_cpu,
                                           req_pool_indices=self.req_pool_indices, num_pages=num_pages)
        if written is None:
            raise self.memory.out_of_memory("decode", num_pages * self.page_size)
        self.out_cache_loc, self.seq_lens = written
        before, self.seq_lens_cpu = self.seq_lens_cpu, self.seq_lens_cpu + 1
        hist = self._page_hist
        if hist is not None and hist.lengths is before:
            hist.lengths, hist.steps = self.seq_lens_cpu, hist.steps + 1
        len_sum = self._len_sum
        if len_sum is not None and len_sum[0] is before:
            self._len_sum = (self.seq_lens_cpu, len_sum[1] + before.numel())

    def decode_run(self, steps: int, grow_records: bool = True) -> np.ndarray:
        """`steps` calls of `prepare_for_decode` at once, where memory can take them with no
        eviction (`MemoryManager.decode_run_steps`): the same slots, lengths and caches
        (`grow_records=False`: the requests' records are left for the caller to lengthen,
        `MemoryManager.grow_records`). Returns the pages each step opened."""
        self.forward_mode = "decode"
        before = self.seq_lens_cpu
        self.out_cache_loc, opened = self.memory.alloc_decode_run(self.reqs if grow_records else None,
                                                                  seq_lens_cpu=before,
                                                                  req_pool_indices=self.req_pool_indices, steps=steps)
        self.seq_lens, self.seq_lens_cpu = self.seq_lens + steps, before + steps
        hist = self._page_hist
        if hist is not None and hist.lengths is before:
            hist.lengths, hist.steps = self.seq_lens_cpu, hist.steps + steps
        len_sum = self._len_sum
        if len_sum is not None and len_sum[0] is before:
            self._len_sum = (self.seq_lens_cpu, len_sum[1] + steps * before.numel())
        return opened

    def decode_run_leaving(self, steps: int, leave_at: np.ndarray) -> np.ndarray:
        """A run of `steps` decode steps whose batch loses requests as it goes, taken at once
        (page size 1): request i has a slot at every step before `leave_at[i]` (0 or past
        `steps`: every step), as `MemoryManager.alloc_decode_run_leaving` takes them. The
        batch keeps its requests and the lengths of the run's start: the caller drops the
        requests that leave (`drop`) and moves the lengths of the rest on by `steps`
        (`advance`) when the run ends. Returns the pages each step took."""
        self.forward_mode = "decode"
        return self.memory.alloc_decode_run_leaving(seq_lens_cpu=self.seq_lens_cpu, req_pool_indices=self.req_pool_indices,
                                                    present=_present(steps, leave_at, 1, steps))

    def paged_run_leaving(self, steps: int, leave_at: np.ndarray) -> PagedRun:
        """`decode_run_leaving` at page size > 1, where a release puts its pages back in front
        of the free list: the run planned at once, its pages taken in pieces and its rows
        written by the caller (`PagedRun`)."""
        self.forward_mode = "decode"
        return self.memory.paged_run_leaving(seq_lens_cpu=self.seq_lens_cpu, req_pool_indices=self.req_pool_indices,
                                             present=_present(steps, leave_at, 1, steps))

    def advance(self, steps: int, kept: np.ndarray | None = None) -> None:
        """The length tensors keep the entries at `kept` (the requests still in the batch, where
        `drop(..., lengths=False)` left the tensors as they were), each `steps` longer: the
        requests left after `decode_run_leaving` had a slot at each of its steps."""
        if kept is not None:
            self._keep_lengths(kept)
        self.seq_lens_cpu = self.seq_lens_cpu + steps
        self.seq_lens = self.seq_lens + steps
        self.out_cache_loc = None

    def decode_ends(self) -> np.ndarray:
        """Per request, the length its row reaches with the slot of its last output but one:
        `input_len + finish - 1`, `finish` the output count that finishes it (its EOS when it
        has one before `max_new_tokens`). Kept with the request list it was read from:
        carried through `filter_batch` and `merge_batch`, read again for any other list."""
        cached, reqs = self._ends, self.reqs
        if cached is None or cached[0] is not reqs or cached[1] != len(reqs):
            ends = np.fromiter(map(_decode_end, reqs), np.int64, len(reqs))
            cached = self._ends = (reqs, len(reqs), ends)
        return cached[2]

    def seq_lens_sum(self) -> int:
        """`int(self.seq_lens_cpu.sum())`, in O(1) per decode step.

        The lengths tensors are replaced, never written in place, so a sum stays true of the
        tensor it was taken from: it is kept with that tensor, moved on by a decode step
        (every length + 1), and taken afresh for any other tensor.
        """
        lengths, len_sum = self.seq_lens_cpu, self._len_sum
        if len_sum is None or len_sum[0] is not lengths:
            len_sum = self._len_sum = (lengths, int(lengths.sum()))
        return len_sum[1]

    def decode_pages_needed(self, page_size: int) -> int:
        """`pages.decode_new_pages(self.seq_lens_cpu, page_size)`, in O(1) per step.

        A histogram of the lengths modulo the page size is built whenever the lengths change
        other than by a decode step (a new batch, a filter, a merge, a restore), and read at
        the offset of the decode steps taken since.
        """
        if page_size == 1:
            return self.seq_lens_cpu.numel()
        hist = self._page_hist
        if hist is None or hist.lengths is not self.seq_lens_cpu or hist.page_size != page_size:
            counts = np.bincount(self.seq_lens_cpu.numpy() % page_size, minlength=page_size).tolist()
            hist = self._page_hist = _PageHistogram(self.seq_lens_cpu, page_size, counts)
        return hist.counts[-hist.steps % page_size]

    def filter_batch(self, keep_indices: list[int] | None = None) -> None:
        """Keep the unfinished requests (or exactly `keep_indices`). Frees nothing."""
        if keep_indices is None:
            if not any(map(_finished, self.reqs)):
                return
            keep_indices = [i for i, r in enumerate(self.reqs) if not r.finished]
        if len(keep_indices) == len(self.reqs) and keep_indices == list(range(len(self.reqs))):
            return
        before = self.reqs
        self._keep([before[i] for i in keep_indices], keep_indices)

    def drop(self, positions: list[int], lengths: bool = True) -> None:
        """`filter_batch` keeping every request but those at `positions` (ascending): the list
        loses them in place of a copy, the index comes from numpy. `lengths=False`: the
        length tensors keep every request (`advance` filters them later)."""
        if not positions:
            return
        reqs = self.reqs.copy()
        for i in reversed(positions):
            del reqs[i]
        keep = np.ones(len(self.reqs), dtype=bool)
        keep[positions] = False
        index = keep.nonzero()[0]  # `np.delete` of the positions, without its argument handling
        if lengths:
            self._keep(reqs, index)
            return
        self._keep_ends(reqs, index)
        self.reqs = reqs

    def _keep(self, reqs: list, keep_indices) -> None:
        """The batch becomes `reqs`, the requests at `keep_indices` (a list or an int64 array)."""
        if not reqs:
            self.reqs = reqs
            self._set_lengths([], [])
            return
        index_np = np.asarray(keep_indices, dtype=np.int64)
        self._keep_ends(reqs, index_np)
        self.reqs = reqs
        self._keep_lengths(index_np)

    def _keep_ends(self, reqs: list, index: np.ndarray) -> None:
        """The cached `decode_ends` of the request list now (if cached) carried to `reqs`, the
        requests at `index` of it."""
        ends, before = self._ends, self.reqs
        if ends is not None and ends[0] is before and ends[1] == len(before):
            self._ends = (reqs, len(reqs), ends[2][index])

    def _keep_lengths(self, index_np: np.ndarray) -> None:
        """The length tensors keep the entries at `index_np`."""
        self.out_cache_loc = None
        if self.device.type == "cpu":  # numpy over the tensors' memory: about half the cost of torch's indexing
            self.seq_lens_cpu = torch.from_numpy(self.seq_lens_cpu.numpy()[index_np])
            self.seq_lens = torch.from_numpy(self.seq_lens.numpy()[index_np])
            self.req_pool_indices = torch.from_numpy(self.req_pool_indices.numpy()[index_np])
            return
        index_cpu = torch.from_numpy(index_np)
        self.seq_lens_cpu = self.seq_lens_cpu[index_cpu]
        index = index_cpu.to(self.device, non_blocking=True)
        self.seq_lens = self.seq_lens[index]
        self.req_pool_indices = self.req_pool_indices[index]

    def merge_batch(self, other: "ScheduleBatch") -> None:
        ends = self._ends
        if ends is not None and ends[0] is self.reqs and ends[1] == len(self.reqs):
            more = np.fromiter(map(_decode_end, other.reqs), np.int64, len(other.reqs))
            self._ends = (self.reqs, len(self.reqs) + len(other.reqs), np.concatenate([ends[2], more]))
        self.reqs.extend(other.reqs)
        self.out_cache_loc = None
        self.seq_lens_cpu = torch.cat([self.seq_lens_cpu, other.seq_lens_cpu])
        self.seq_lens = torch.cat([self.seq_lens, other.seq_lens])
        self.req_pool_indices = torch.cat([self.req_pool_indices, other.req_pool_indices])

    def _set_lengths(self, rows: list[int], seq_lens: list[int]) -> None:
        self.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
        self.seq_lens = self.seq_lens_cpu.to(self.device, non_blocking=True)
        self.req_pool_indices = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)

    def check_decode_mem(self, keep: list[int] | None = None) -> bool:
        """True when the next decode step fits (evicting the shortfall from the tree)."""
        return self.memory.can_decode(self.estimated_decode_pages(keep))

    def estimated_decode_pages(self, keep: list[int] | None = None) -> int:
        """SGLang's `new_page_count_next_decode` over all requests (or those at `keep`).

        Normal loop: the pages the next decode opens, from the KV lengths (`(seqlen - 1) % ps
        == 0` in SGLang's terms). Overlap loop: SGLang counts `seqlen % ps == 0`, exact while
        the outputs lag the KV by one step, and one page off for requests whose last result
        was already processed (a prefill step ran in between); the allocation itself always
        opens the exact pages.
        """
        ps = self.page_size
        if self.enable_overlap and ps > 1:
            reqs = self.reqs if keep is None else [self.reqs[i] for i in keep]
            opening = 0
            for r in reqs:  # a plain loop: a generator resumed per request costs more than the count
                if (r.input_len + len(r.output_ids)) % ps == 0:  # r.seqlen, inlined
                    opening += 1
            return opening
        if keep is None:
            return self.decode_pages_needed(ps)
        return pages.decode_new_pages(self.seq_lens_cpu[torch.tensor(keep, dtype=torch.int64)], ps)

    def retract_decode(self, retract_decode_steps: int, keep_victim_order: bool = False,
                       release=None) -> tuple[list, float]:
        """Release requests until the next decode step fits; at least one when bs > 1.

        `release(req)` frees a victim (default: `memory.release(req, Release.RETRACTED)`; the
        overlap loop keeps the slot of a decode still in flight apart).

        Victims: fewest output tokens first, ties by longest prompt. The requests kept stay
        in their order, or with `keep_victim_order` (SGLang) in the victim sort's order.
        Returns the retracted requests and the new-token ratio of the rest.
        """
        order = sorted(range(len(self.reqs)),
                       key=lambda i: (len(self.reqs[i].output_ids), -self.reqs[i].input_len), reverse=True)
        retracted = []
        while True:
            if len(order) == 1:
                break
            idx = order.pop()
            req = self.reqs[idx]
            retracted.append(req)
            if release is None:
                self.memory.release(req, Release.RETRACTED)
            else:
                release(req)
            self.memory.evict_for(len(order) * retract_decode_steps)
            if self.check_decode_mem(sorted(order)):
                break
        self.filter_batch(order if keep_victim_order else sorted(order))
        for req in retracted:
            req.reset_for_retract()
        total_out = sum(len(r.output_ids) for r in self.reqs)
        total_max = sum(r.max_new_tokens for r in self.reqs)
        ratio = min(1.0, (total_out + retract_decode_steps * len(self.reqs)) / (total_max + 1))
        return retracted, ratio


class _PageHistogram:
    """Requests per length modulo the page size, for the lengths `lengths`, `steps` decode
    steps ago. The requests opening a page now are those with (length + steps) % ps == 0."""

    __slots__ = ("lengths", "page_size", "counts", "steps")

    def __init__(self, lengths: torch.Tensor, page_size: int, counts: list[int]):
        self.lengths, self.page_size, self.counts, self.steps = lengths, page_size, counts, 0
