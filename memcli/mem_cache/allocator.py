"""KV slot allocators: one interface, token-granular (page size 1) or paged.

Free-list semantics follow the reference stack exactly (so allocations are reproducible slot
for slot), but the storage is a preallocated buffer instead of a tensor re-built by `cat` on
every call:

* `TokenToKVPoolAllocator` is FIFO: slots are taken from the head, freed slots are appended
  at the tail (a ring buffer; `free` costs O(freed), not O(free list)).
* `PagedTokenToKVPoolAllocator` takes pages from the head and puts freed pages, sorted and
  de-duplicated, back in front of the head (a stack growing downwards in the buffer).

Lengths of the free lists are host integers, so capacity is checked on the host before any
kernel runs and nothing on the decode path synchronises with the device. `None` means "not
enough free slots"; nothing is changed in that case.

Slot 0 (page 0 when paged) is padding and never handed out.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol

import numpy as np
import torch

from memcli import kernels
from memcli.check_result import CheckResult, IntegrityReport
from memcli.mem_cache.pages import decode_new_pages, page_ids

# Claims one step of a decode run taken at once: (step of the run, the slots it wrote, in batch order).
RunObserver = Callable[[int, np.ndarray], None]


def _divided(entries: torch.Tensor, divisor: int) -> Any:
    """`entries // divisor` (page ids of slots), for the observer: on a CPU in numpy
    (`pages.page_ids`), else on the device."""
    if divisor == 1:
        return entries
    return page_ids(entries.numpy(), divisor) if entries.is_cpu else entries // divisor


class AllocatorState(NamedTuple):
    """Snapshot taken by `backup_state` (a copy of the free list: O(free pages))."""

    free_pages: torch.Tensor
    release_pages: torch.Tensor
    in_use_pages: int
    ledger: object = None  # the observer's state (`AllocationObserver.snapshot`), when one is attached


class AllocationObserver(Protocol):
    """Told what an allocator hands out and takes back (the ownership ledger, while checking).

    Pages are page ids (slots when page_size == 1): a numpy array or a tensor, read during the
    call and never kept. Each method may raise (a page given twice, freed behind its owner's
    back); the allocator has not changed its free list yet when it does."""

    def handed_out(self, pages: Any, claimed: bool) -> None:
        """`pages` left the free list; `claimed`: the caller claims them at once, in its next
        call on the observer (the fused extend and decode paths)."""

    def taken_back(self, pages: Any, owner: Any, op: str, sorted_pages: bool = False) -> None:
        """`pages` return to the free list from `owner`, as the caller of `free` named it (None:
        nobody, pages already released), in operation `op`; `sorted_pages`: sorted ids."""

    def cleared(self) -> None:
        """Every page is free again (`clear`)."""

    def snapshot(self) -> Any:
        """A copy of the observer's state, kept with a `backup_state`."""

    def restore(self, state: Any) -> None:
        """Back to a `snapshot` (`restore_state`)."""


class DecodeAllocation(NamedTuple):
    """What a decode step's memory path hands back to the batch: the new slots, and the
    device lengths after the step (the old ones plus one: computed by the graph replay in its
    own buffer, else a new tensor)."""

    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor


class BaseAllocator:
    """Shared bookkeeping; subclasses define the free-list order."""

    page_size: int
    # The observer of what this allocator hands out and takes back: the ownership ledger
    # (`integrity.track`), attached only while checking incrementally. The allocation entry
    # points and the trees reach the ledger's other verbs (claims, moves) through it too.
    ledger: Optional[AllocationObserver] = None
    # The decode step as a CUDA-graph replay (`decode_graph.DecodeGraphs`), when enabled.
    decode_graphs = None
    # The free of rows as a CUDA-graph replay (`free_graph.FreeRowsGraphs`), when enabled.
    free_graphs = None
    # The extend's slots and rows as a CUDA-graph replay (`extend_graph.ExtendGraphs`), when enabled.
    extend_graphs = None

    def __init__(self, size: int, page_size: int, device: torch.device, backend: str = "torch",
                 need_sort: bool = False, debug: bool = False):
        if size % page_size:
            raise ValueError(f"allocator size {size} is not a multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = device
        self.backend = backend
        self.need_sort = need_sort
        self.debug = debug
        # Whether `free_rows` may take its one launch, as far as the allocator's fixed settings go.
        self._free_rows_fused = backend == "triton" and not need_sort and not debug
        self._buf = torch.empty(self.num_pages, dtype=torch.int64, device=device)
        self._buf_host = self._buf.numpy() if self._buf.device.type == "cpu" else None  # the same memory
        self.clear()

    # -- free-list storage, specialised by subclasses ------------------------------------
    def _free_list(self) -> torch.Tensor:
        """The free list in allocation order (a fresh tensor or a view)."""
        raise NotImplementedError

    def _set_free_list(self, pages: torch.Tensor) -> None:
        raise NotImplementedError

    def _take(self, n: int) -> torch.Tensor:
        """Remove and return the first `n` free entries (caller checked the length)."""
        raise NotImplementedError

    def _put(self, pages: torch.Tensor, divisor: int = 1) -> None:
        """Return `pages // divisor` to the free list in this allocator's order."""
        raise NotImplementedError

    def _head_view(self, n: int) -> torch.Tensor:
        """The first `n` free entries, without removing them (for `alloc` and the ledger). The
        fused kernels read the buffer itself from `_head` (a ring of `_num_free` entries)."""
        raise NotImplementedError

    def _advance(self, n: int, claimed: bool = False) -> None:
        """Remove the first `n` free entries after a kernel read them through `_head_view`.
        The observer, when attached, is told (`handed_out`): claimed by the caller at once,
        or loose until claimed."""
        if self.ledger is not None:
            self.ledger.handed_out(self._head_host(n), claimed)
        self._move_head(n)
        self._num_free -= n

    def _move_head(self, n: int) -> None:
        """The free list's head moves past `n` entries."""
        raise NotImplementedError

    @property
    def free_head(self) -> int:
        """Where the free list starts in the ring the fused kernels read (`_buf`)."""
        return self._head

    def _head_host(self, n: int):
        """`_head_view(n)` for the observer: a numpy view on the CPU (slicing a tensor
        costs more than the ledger's work on a decode step), else the tensor view."""
        return self._head_view(n)

    @property
    def runs_decode(self) -> bool:
        """`alloc_decode_run_write` can serve this allocator: host memory, the torch backend,
        no graphs, no debug checks, no release list (an observer is told step by step)."""
        return (self._buf_host is not None and self.backend == "torch" and self.decode_graphs is None
                and not self.debug and not self.need_sort)

    def _took_run(self, slots: np.ndarray, opened: np.ndarray, observe: Optional[RunObserver]) -> None:
        """A run of decode steps wrote `slots` (one line per step) into the rows: the free
        list's head moves past the `opened` pages of each step. Without an observer in one
        move; with one, step by step as the steps one by one would (each step's hand-out
        claimed at once), `observe(step, slots)` making each step's claim."""
        if self.ledger is None:
            pages = int(opened.sum())
            self._advance(pages)
            self._commit_alloc(pages)
            return
        for step, pages in enumerate(opened.tolist()):
            self._advance(pages, claimed=True)
            self._commit_alloc(pages)
            observe(step, slots[step])

    def _decode_write(self, seq_lens, req_pool_indices, req_to_token, num_pages: int,
                      claimed: bool) -> DecodeAllocation:
        """The decode step after the capacity check: one launch, or one graph replay."""
        graphs = self.decode_graphs
        if graphs is None or req_to_token is not graphs.req_to_token:
            # The first `num_pages` free entries are the ones the step may take.
            out = kernels.alloc_decode_write(seq_lens, req_pool_indices, req_to_token, self._buf, self.page_size,
                                             backend=self.backend, validate=self.debug, free_start=self._head,
                                             num_free=num_pages)
            self._advance(num_pages, claimed)
            self._commit_alloc(num_pages)
            return DecodeAllocation(out, seq_lens + 1)
        before = (self._head, self._num_free)
        self._advance(num_pages, claimed)
        self._commit_alloc(num_pages)
        return graphs.step(seq_lens, req_pool_indices, before, (self._head, self._num_free))

    # -- common API -----------------------------------------------------------------------
    def clear(self) -> None:
        """Everything free again: pages 1..num_pages in order, no release list, no group."""
        self._set_free_list(torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device))
        self._release: list[torch.Tensor] = []
        self._num_release = 0
        self._in_use_pages = 0
        self._group: list[torch.Tensor] | None = None
        self._group_segments: list[torch.Tensor] = []
        self.num_frees = 0  # calls that returned pages (a free group counts once)
        self.freed_tokens = 0
        if self.ledger is not None:
            self.ledger.cleared()

    def available_size(self) -> int:
        """Free slots in tokens (free list plus pending release list)."""
        return (self._num_free + self._num_release) * self.page_size

    def _ensure(self, num_pages: int) -> bool:
        """True when `num_pages` can be taken now, merging the release list if needed."""
        if num_pages > self._num_free and self._num_release:
            self.merge_and_sort_free()
        return num_pages <= self._num_free

    def merge_and_sort_free(self) -> None:
        if not self._num_release:
            return
        merged = torch.cat([self._free_list()] + self._release)
        self._set_free_list(torch.sort(merged).values)
        self._release, self._num_release = [], 0

    def free(self, indices: torch.Tensor, distinct_pages: bool = False, _grouped: bool = False, *,
             owner: Any = None, op: str = "allocator.free", segment: bool = False) -> None:
        """Free KV slots. Paged: frees the whole page of every slot given (de-duplicated).

        `distinct_pages`: the caller guarantees that no two of `indices` share a page (one
        slot per page, as when freeing every page of a request row through columns 0, ps,
        2 ps, ...). The pages are then sorted instead of de-duplicated, which needs no host
        sync. `indices` may have any shape and integer dtype. Inside a free group the
        guarantee is dropped (other frees may share pages).

        `owner` / `op` (with an observer only): who owned the pages until now (an owner code of
        `memcli.mem_cache.integrity.owners`, a row, or one row per entry as an array), and the operation,
        when the caller frees them straight from their owner: the observer is told in one call
        (`taken_back`). The default (None) is a plain free of pages already released.

        `segment` (SGLang 0.5.23's `free_segment`): `indices` are a page-aligned run of one
        request row; paged, one slot per page is taken, and the pages go back in row order,
        neither sorted nor de-duplicated.
        """
        if indices.numel() == 0:
            return
        paged_segment = segment and self.page_size > 1
        if self._group is not None:
            starts = self._page_starts(indices) if paged_segment else None
            if self.ledger is not None:  # each call on its own: the group's cat would merge a double free
                if paged_segment:
                    self._observe_free(starts, False, owner, op, self.page_size, True)
                else:
                    self._observe_free(indices, distinct_pages, owner, op)
            # Kept until the group ends: an int32 view of a request row (which may be reused
            # before then) is copied, as the int64 conversion the group's cat needs anyway.
            # Segments (0.5.23's free_page_ids_group): one slot per page, released after the rest.
            if paged_segment:
                self._group_segments.append(starts if starts.dtype == torch.int64 else starts.to(torch.int64))
            else:
                self._group.append(indices.reshape(-1).to(torch.int64))
            return
        if _grouped == "segments":
            entries, divisor = indices, self.page_size
        elif paged_segment:
            entries, divisor = self._page_starts(indices), self.page_size
        else:
            entries, divisor = self._freed_entries(indices, distinct_pages)
        if self.ledger is not None and not _grouped:  # raises on a double free, or a free behind the owner's back
            if not isinstance(owner, np.ndarray):
                self._observe_free(entries, distinct_pages, owner, op, divisor, in_order=segment)
            else:
                self._observe_free(indices, distinct_pages, owner, op)
        n = entries.numel()
        if self._in_use_pages - n < 0:
            raise ValueError(
                f"double free: freeing {n} pages but only {self._in_use_pages} are allocated"
            )
        self._in_use_pages -= n
        self.num_frees += 1
        self.freed_tokens += n * self.page_size
        if self.need_sort:
            # An own copy: with page size 1 the entries can be the caller's tensor.
            pages = entries // divisor if divisor > 1 else entries.clone()
            self._release.append(pages.reshape(-1).to(torch.int64))
            self._num_release += n
        else:
            self._put(entries, divisor)
        if self.debug:
            self.check_integrity().raise_if_failed()

    def _page_starts(self, slots: torch.Tensor) -> torch.Tensor:
        """`slots.reshape(-1)[::page_size]`: one slot per page of a page-aligned run, as a view.
        On a CPU the view is taken in numpy (a strided torch slice costs ten times more)."""
        if slots.is_cpu:
            return torch.from_numpy(slots.numpy().reshape(-1)[:: self.page_size])
        return slots.reshape(-1)[:: self.page_size]

    def free_rows(self, req_to_token: torch.Tensor, rows: list[int], length: int, consecutive: bool,
                  row_index: Optional[torch.Tensor] = None) -> bool:
        """`free` of every page of columns [0, length) of request rows that hold only their own
        slots, in one launch that reads the rows and writes the free list (`kernels.free_rows_triton`):
        the same free list and counters as `free` of the rows' page-start columns with
        `distinct_pages`. False, with nothing done, where that launch does not apply (the
        torch backend, an observer, a free group, a release list, debug mode, rows neither
        consecutive nor given on the device, or more pages than one program sorts). With
        `free_graphs`, consecutive rows whose pages one program takes replay a graph instead."""
        if not self._free_rows_fused:  # the backend, debug mode and the sort: fixed for the allocator
            return False
        ps, num_rows = self.page_size, len(rows)
        n = num_rows * ((length + ps - 1) // ps)
        if (self.ledger is not None or self._group is not None or not n
                or (num_rows > 1 and not consecutive and row_index is None)
                or (ps > 1 and n > kernels.FREE_ROWS_SORT_MAX)):
            return False
        if self._in_use_pages < n:
            raise ValueError(f"double free: freeing {n} pages but only {self._in_use_pages} are allocated")
        dest = self._free_rows_dest(n)
        graphs = self.free_graphs
        if (graphs is None or (num_rows > 1 and not consecutive)
                or not graphs.free(req_to_token, rows[0], num_rows, length, dest)):
            kernels.free_rows_triton(req_to_token, rows[0], None if consecutive or num_rows == 1 else row_index,
                                     num_rows, length, self._buf, dest, ps, ps > 1)
        self._in_use_pages -= n
        self.num_frees += 1
        self.freed_tokens += n * ps
        return True

    def _free_rows_dest(self, n: int) -> int:
        """Where `n` freed pages go in the free list, which takes them (as `_put` does)."""
        raise NotImplementedError

    def _observe_free(self, indices: torch.Tensor, distinct_pages: bool, owner: Any, op: str,
                      divisor: int = 0, in_order: bool = False) -> None:
        """The observer's side of a free: the freed pages, from `owner`. `divisor` 0: `indices`
        are the caller's slots (not yet `_freed_entries`)."""
        if isinstance(owner, np.ndarray):  # one row per entry: the caller's order, one slot per page
            self.ledger.taken_back(_divided(indices, self.page_size), owner, op)
            return
        if not divisor:
            indices, divisor = self._freed_entries(indices, distinct_pages)
        pages = _divided(indices, divisor)
        # Paged, the entries are sorted: de-duplicated by `unique`, or (the caller's word,
        # `distinct_pages`) checked by comparing neighbours, not with the scratch array.
        self.ledger.taken_back(pages, owner, op, sorted_pages=self.page_size > 1 and not in_order)

    def free_group_begin(self) -> None:
        self._group = []
        self._group_segments: list[torch.Tensor] = []

    def free_group_end(self) -> None:
        group, self._group = self._group, None
        if group:
            self.free(torch.cat(group), _grouped=True)  # the observer saw each call already
        segments, self._group_segments = self._group_segments, []
        if segments:  # in call order, in row order, in front of the pages just freed
            self.free(torch.cat(segments), _grouped="segments")

    def backup_state(self) -> AllocatorState:
        release = torch.cat(self._release) if self._release else self._buf[:0].clone()
        ledger = self.ledger.snapshot() if self.ledger is not None else None
        return AllocatorState(self._free_list().clone(), release, self._in_use_pages, ledger)

    def restore_state(self, state: AllocatorState) -> None:
        self._set_free_list(state.free_pages.clone())
        self._release = [state.release_pages.clone()] if state.release_pages.numel() else []
        self._num_release = state.release_pages.numel()
        self._in_use_pages = state.in_use_pages
        if self.ledger is not None and state.ledger is not None:
            self.ledger.restore(state.ledger)
        if self.decode_graphs is not None:  # the next decode step starts from the restored free list
            self.decode_graphs.place(self._head, self._num_free)

    def alloc_extend_write(self, req_to_token: torch.Tensor, rows: list[int], prefix_lens_cpu: torch.Tensor,
                           seq_lens_cpu: torch.Tensor, prefixes: list[torch.Tensor], num_pages: int,
                           extend_num_tokens: int | None = None, claimed: bool = False,
                           host_plan: np.ndarray | None = None,
                           kept_prefix: list[int] | None = None) -> kernels.ExtendWrite | None:
        """Slots for an extend batch, written with each request's prefix into its row (one
        fused kernel; see `memcli.kernels.alloc_extend_write`). `num_pages` is the batch's
        new pages, counted by the caller from the same CPU lengths. None when they are not free.
        The kernel's inputs are checked in debug mode only (the callers build them right), and
        it may read exactly `num_pages` free entries: a miscount shows as slot -1, never as a
        page handed out twice. `claimed`: the caller claims the new slots in the observer
        right after (the ownership ledger's `extended`), which folds the hand-out into the claim.
        `host_plan`: the kernel's plan, built when the batch was planned (`extend_host_plan`).
        `kept_prefix`: per request, the prefix slots its row holds already (`ExtendPlan`),
        which the torch backend on a CPU leaves as they are.
        """
        if num_pages > self._num_free and not self._ensure(num_pages):  # the check inline: a steady batch has the pages
            return None
        graphs = self.extend_graphs
        written = None if graphs is None else graphs.write(req_to_token, rows, prefix_lens_cpu, seq_lens_cpu, prefixes,
                                                           self._head, num_pages, extend_num_tokens, host_plan)
        if written is None:
            # The backend's function itself, its arguments in order (one call layer less on the memory path).
            write = kernels.alloc_extend_write_triton if self.backend == "triton" else kernels.alloc_extend_write_torch
            written = write(req_to_token, rows, prefix_lens_cpu, seq_lens_cpu, prefixes, self._buf, self.page_size,
                            extend_num_tokens, self.debug, self._head, num_pages, host_plan, kept_prefix)
        self._advance(num_pages, claimed)
        self._commit_alloc(num_pages)
        return written

    def _commit_alloc(self, num_pages: int) -> None:
        self._in_use_pages += num_pages
        if self.debug:
            self.check_integrity().raise_if_failed()

    def _freed_entries(self, slots: torch.Tensor, distinct: bool) -> tuple[torch.Tensor, int]:
        """What a free puts back, as (entries, divisor): the freed pages are `entries // divisor`,
        one entry per page, in the order they go back. Page size 1: the slots themselves
        (`_put` converts their dtype as it copies)."""
        return slots, 1

    # -- introspection ----------------------------------------------------------------------
    def free_page_ids(self) -> torch.Tensor:
        parts = [self._free_list()] + self._release
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def free_slot_ids(self) -> torch.Tensor:
        """Every free slot (pages expanded), for integrity walks."""
        pages = self.free_page_ids()
        if self.page_size == 1:
            return pages
        offsets = torch.arange(self.page_size, device=pages.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    @property
    def in_use_tokens(self) -> int:
        return self._in_use_pages * self.page_size

    def check_integrity(self) -> IntegrityReport:
        """Free list in range, no duplicate, page 0 never free, available + in use == size."""
        pages = self.free_page_ids().cpu().numpy()
        n = len(pages)
        # Two reductions over the list, and the element-wise masks only when one fails.
        low, high = (int(pages.min()), int(pages.max())) if n else (1, self.num_pages)
        in_range = low >= 1 and high <= self.num_pages
        dup = n - _distinct_count(pages, self.num_pages, in_range) if n else 0
        zero = low <= 0 and bool((pages == 0).any())
        avail, used = self.available_size(), self.in_use_tokens
        unit = "pages" if self.page_size > 1 else "slots"
        return IntegrityReport(
            f"allocator(page_size={self.page_size})",
            [
                CheckResult("free list within range", in_range,
                            f"{n} free {unit}, valid ids 1..{self.num_pages}"),
                CheckResult("no duplicate in free list", dup == 0, f"{dup} duplicate {unit}"),
                CheckResult("slot 0 never free", not zero,
                            "page 0 is padding" if not zero else "page 0 is in the free list"),
                CheckResult("available + in use == size", avail + used == self.size,
                            f"available {avail} + in use {used} vs size {self.size}"),
            ],
        )


def _distinct_count(ids: np.ndarray, num_pages: int, in_range: bool = False) -> int:
    """`len(np.unique(ids))` for page ids, in one pass: ids in [0, num_pages] are marked in
    a scratch array (a sort of a 4 Mi-slot free list costs a quarter of a second), the rare
    ids outside it are counted by `np.unique`. `in_range`: every id is known to be in
    [1, num_pages] (no mask needed)."""
    if in_range:
        inside, outside = ids, ids[:0]
    else:
        mask = (ids >= 0) & (ids <= num_pages)
        inside, outside = ids[mask], ids[~mask]
    marks = np.zeros(num_pages + 1, dtype=np.bool_)
    marks[inside] = True
    return int(np.count_nonzero(marks)) + (len(np.unique(outside)) if len(outside) else 0)


class TokenToKVPoolAllocator(BaseAllocator):
    """Page size 1. FIFO reuse: freed slots go to the tail of a ring buffer."""

    def __init__(self, size: int, device: torch.device, backend: str = "torch",
                 need_sort: bool = False, debug: bool = False):
        super().__init__(size, 1, device, backend, need_sort, debug)

    def _set_free_list(self, pages: torch.Tensor) -> None:
        n = pages.numel()
        self._buf[:n] = pages
        self._head, self._num_free = 0, n

    def _free_list(self) -> torch.Tensor:
        return self._ring_slice(self._head, self._num_free)

    def _ring_slice(self, start: int, n: int) -> torch.Tensor:
        cap = self.num_pages
        end = start + n
        if end <= cap:
            return self._buf[start:end]
        return torch.cat([self._buf[start:], self._buf[: end - cap]])

    def _head_view(self, n: int) -> torch.Tensor:
        return self._ring_slice(self._head, n)

    def _move_head(self, n: int) -> None:
        self._head = (self._head + n) % self.num_pages

    def _head_host(self, n: int):
        buf, start, cap = self._buf_host, self._head, self.num_pages
        if buf is None:
            return self._head_view(n)
        if start + n <= cap:
            return buf[start : start + n]
        return np.concatenate([buf[start:], buf[: start + n - cap]])

    def _take(self, n: int) -> torch.Tensor:
        # A copy: the ring positions are rewritten by later frees.
        out = self._head_view(n).clone()
        self._advance(n)
        return out

    def _put(self, pages: torch.Tensor, divisor: int = 1) -> None:
        cap, n = self.num_pages, pages.numel()
        if self._num_free + n > cap:
            raise ValueError(f"double free: {self._num_free} free + {n} freed > size {cap}")
        tail = (self._head + self._num_free) % cap
        host = self._buf_host
        if tail + n <= cap and host is not None and pages.is_cpu:  # a numpy slice copy: no torch dispatch
            host[tail : tail + n] = pages.numpy().reshape(-1)  # converts the dtype as it copies
        elif tail + n <= cap:  # one copy, whatever the shape, strides and dtype of `pages`
            dest = self._buf[tail : tail + n]
            (dest if pages.dim() == 1 else dest.view(pages.shape)).copy_(pages)
        else:
            flat, first = pages.reshape(-1), cap - tail
            self._buf[tail:] = flat[:first]
            self._buf[: n - first] = flat[first:]
        self._num_free += n

    def _free_rows_dest(self, n: int) -> int:
        cap = self.num_pages
        if self._num_free + n > cap:
            raise ValueError(f"double free: {self._num_free} free + {n} freed > size {cap}")
        tail = (self._head + self._num_free) % cap
        self._num_free += n
        return tail

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` slots in free-list order, or None when fewer are free."""
        if not self._ensure(n):
            return None
        out = self._take(n)
        self._commit_alloc(n)
        return out

    def alloc_decode_write(self, seq_lens, seq_lens_cpu, req_pool_indices, req_to_token,
                           num_pages: int | None = None, claimed: bool = False) -> DecodeAllocation | None:
        """Allocate one slot per request and write it at column `seq_lens` (one kernel)."""
        bs = seq_lens.numel()
        if bs > self._num_free and not self._ensure(bs):  # the check inline: a steady step has the pages
            return None
        return self._decode_write(seq_lens, req_pool_indices, req_to_token, bs, claimed)


    def alloc_decode_run_write(self, seq_lens_cpu: torch.Tensor, req_pool_indices: torch.Tensor,
                               req_to_token: torch.Tensor, opened: np.ndarray,
                               observe: Optional[RunObserver] = None) -> torch.Tensor:
        """`len(opened)` decode steps of one batch at once (`runs_decode`; the `bs` pages each
        step opens are free): step s takes the next `bs` entries of the ring and writes them
        at column `seq_lens_cpu + s`, as that many calls of `alloc_decode_write` would. With
        an observer attached, `observe` claims each step's slots (`_took_run`). Returns the
        last step's slots (a copy)."""
        bs, steps = seq_lens_cpu.numel(), len(opened)
        slots = np.asarray(self._head_host(steps * bs)).reshape(steps, bs)
        columns = seq_lens_cpu.numpy() + np.arange(steps, dtype=np.int64)[:, None]
        req_to_token.numpy()[req_pool_indices.numpy(), columns] = slots  # int64 -> int32, as the kernel
        out = torch.from_numpy(slots[-1].copy())
        self._took_run(slots, opened, observe)
        return out

    def alloc_decode_run_leaving_write(self, seq_lens_cpu: torch.Tensor, req_pool_indices: torch.Tensor,
                                       req_to_token: torch.Tensor, present: np.ndarray) -> np.ndarray:
        """`alloc_decode_run_write` of a batch that loses requests as the run goes: step s
        writes a slot for request i only where `present[s, i]`, taking the next entries of
        the ring in step, then batch order, at column `seq_lens_cpu[i] + s` (each step's
        batch is the requests present, in their order: the slots that step's own call would
        take). No observer. Returns the slots each step took; raises ValueError, taking
        nothing, when they are not free."""
        if self.ledger is not None:
            raise ValueError("alloc_decode_run_leaving_write: a ledger is told each step on its own")
        steps = present.shape[0]
        opened = np.count_nonzero(present, axis=1)
        total = int(opened.sum())
        if total > self._num_free:
            raise ValueError(f"{steps} decode steps need {total} slots, {self._num_free} are free")
        slots = np.asarray(self._head_host(total))
        rows = np.broadcast_to(req_pool_indices.numpy(), present.shape)[present]
        columns = (seq_lens_cpu.numpy() + np.arange(steps, dtype=np.int64)[:, None])[present]
        req_to_token.numpy()[rows, columns] = slots  # int64 -> int32, as the kernel
        self._took_run(slots, opened, None)
        return opened


class PagedTokenToKVPoolAllocator(BaseAllocator):
    """Page size > 1. Pages are taken from the head; freed pages are put back in front."""

    def _set_free_list(self, pages: torch.Tensor) -> None:
        n = pages.numel()
        self._head = self.num_pages - n
        self._buf[self._head :] = pages
        self._num_free = n

    def _free_list(self) -> torch.Tensor:
        return self._buf[self._head :]

    def _head_view(self, n: int) -> torch.Tensor:
        return self._buf[self._head : self._head + n]

    def _move_head(self, n: int) -> None:
        self._head += n

    def _head_host(self, n: int):
        if self._buf_host is None:
            return self._head_view(n)
        return self._buf_host[self._head : self._head + n]

    def _take(self, n: int) -> torch.Tensor:
        out = self._head_view(n)
        self._advance(n)
        return out

    def _put(self, pages: torch.Tensor, divisor: int = 1) -> None:
        n = pages.numel()
        if n > self._head:
            raise ValueError(f"double free: {self._num_free} free + {n} freed pages > {self.num_pages}")
        self._head -= n
        host = self._buf_host
        if host is not None and pages.is_cpu:  # numpy over the free list's memory: no torch dispatch
            dest_host = host[self._head : self._head + n]
            if divisor == 1:
                dest_host[:] = pages.numpy().reshape(-1)  # converts the dtype as it copies
            elif divisor & (divisor - 1) or pages.dtype != torch.int64:
                np.floor_divide(pages.numpy().reshape(-1), divisor, out=dest_host)
            else:  # a power of two: the arithmetic shift is the floor division, under half its cost on long runs
                np.right_shift(pages.numpy().reshape(-1), divisor.bit_length() - 1, out=dest_host)
            self._num_free += n
            return
        dest = self._buf[self._head : self._head + n]
        if divisor == 1:
            dest.copy_(pages)  # converts the dtype as it copies
        else:  # the division writes straight into the free list
            torch.floor_divide(pages, divisor, out=dest)
        self._num_free += n

    def _free_rows_dest(self, n: int) -> int:
        if n > self._head:
            raise ValueError(f"double free: {self._num_free} free + {n} freed pages > {self.num_pages}")
        self._head -= n
        self._num_free += n
        return self._head

    def _freed_entries(self, slots: torch.Tensor, distinct: bool) -> tuple[torch.Tensor, int]:
        # Sorted and de-duplicated pages, like the reference; `unique` synchronises with the
        # device, `sort` (enough when the caller knows the pages are distinct) does not.
        # Slots on distinct pages sort in page order, so they are sorted as slots and divided
        # as they are written into the free list.
        if distinct:
            return torch.sort(slots.reshape(-1)).values, self.page_size
        return torch.unique(slots.reshape(-1) // self.page_size), 1

    def alloc(self, n: int) -> torch.Tensor | None:
        """Whole pages only: `n` must be a multiple of the page size."""
        if n % self.page_size:
            raise ValueError(f"paged alloc({n}): not a multiple of page_size {self.page_size}")
        num_pages = n // self.page_size
        if not self._ensure(num_pages):
            return None
        pages = self._take(num_pages)
        self._commit_alloc(num_pages)
        offsets = torch.arange(self.page_size, device=pages.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def alloc_decode_write(self, seq_lens, seq_lens_cpu, req_pool_indices, req_to_token,
                           num_pages: int | None = None, claimed: bool = False) -> DecodeAllocation | None:
        """Fused decode step: `seq_lens` are the lengths before the new token, whose slot is
        written at column `seq_lens` of each request row. `num_pages` (the pages this step
        opens) may be passed when the caller already counted them."""
        if num_pages is None:
            num_pages = decode_new_pages(seq_lens_cpu, self.page_size)
        if num_pages > self._num_free and not self._ensure(num_pages):
            return None
        return self._decode_write(seq_lens, req_pool_indices, req_to_token, num_pages, claimed)

    def alloc_decode_run_write(self, seq_lens_cpu: torch.Tensor, req_pool_indices: torch.Tensor,
                               req_to_token: torch.Tensor, opened: np.ndarray,
                               observe: Optional[RunObserver] = None) -> torch.Tensor:
        """`len(opened)` decode steps of one batch at once (`runs_decode`; the pages they open,
        `opened[s]` at step s, are free), as that many calls of `alloc_decode_write` would: step
        s writes position `seq_lens_cpu + s` of each row, a request whose position starts a
        page taking the next free page (page-takers in step, then batch order), the others the
        slot after their last one. With an observer attached, `observe` claims each step's
        slots (`_took_run`). Returns the last step's slots."""
        ps, lengths, steps = self.page_size, seq_lens_cpu.numpy(), len(opened)
        pages = int(opened.sum())
        bs, rows = lengths.shape[0], req_pool_indices.numpy()
        table = req_to_token.numpy()
        positions = lengths + np.arange(steps, dtype=np.int64)[:, None]  # (steps, bs)
        offset = positions % ps
        slots = self._run_slots(lengths, rows, table, positions, offset, offset == 0, pages)
        table[rows, positions] = slots
        out = torch.from_numpy(slots[-1].copy())
        self._took_run(slots, opened, observe)
        return out

    def decode_run_leaving(self, seq_lens_cpu: torch.Tensor, req_pool_indices: torch.Tensor,
                           req_to_token: torch.Tensor, present: np.ndarray) -> "PagedRun":
        """A run of decode steps whose batch loses requests as the steps go (`present[s, i]`:
        request i is in step s's batch), taken in pieces (`PagedRun`): freed pages go back in
        front of the free list, so the steps after a release take what it freed, as each
        step's own `alloc_decode_write` would. No observer: a ledger is told each step on its
        own (raises ValueError)."""
        if self.ledger is not None:
            raise ValueError("decode_run_leaving: a ledger is told each step on its own")
        return PagedRun(self, seq_lens_cpu.numpy(), req_pool_indices.numpy(), req_to_token.numpy(), present)

    def take_run_pages(self, out: np.ndarray) -> None:
        """The next `len(out)` free pages, copied into `out`, out of the free list (a run's
        page-takers', in step then batch order). Raises ValueError, taking nothing, when fewer
        are free."""
        n = len(out)
        if n > self._num_free:
            raise ValueError(f"decode steps need {n} pages, {self._num_free} are free")
        out[:] = self._buf_host[self._head : self._head + n]
        self._advance(n)
        self._commit_alloc(n)

    def _run_slots(self, lengths: np.ndarray, rows: np.ndarray, table: np.ndarray, positions: np.ndarray,
                   offset: np.ndarray, opens: np.ndarray, pages: int) -> np.ndarray:
        """The slots of a run's positions (`positions`, steps x requests, `offset` their
        offsets in a page): a position on a page the run opened (`opens`: where a page-taker
        sits; `pages` of them) lies on the free page of that taker's place among them, in step
        then batch order; the others continue the row's last page before the run."""
        taker = np.cumsum(opens.reshape(-1)).reshape(opens.shape) - 1 if pages else None  # each page-taker's place
        last = table[rows, np.maximum(lengths - 1, 0)].astype(np.int64)
        return _run_slot_values(positions, offset, lengths, last, taker, np.arange(positions.shape[1]),
                                self._buf_host[self._head : self._head + pages], self.page_size)


def _run_slot_values(positions: np.ndarray, offset: np.ndarray, lengths: np.ndarray, last: np.ndarray,
                     taker: Optional[np.ndarray], cols: np.ndarray, pages: np.ndarray, page_size: int) -> np.ndarray:
    """The slots of a run's positions (steps x the requests at `cols` of the run's batch, at
    `offset` in their pages; `lengths` and `last` their rows' lengths and last slots before
    the run): a position on a page the run opened lies on the page of the taker that opened it
    (`taker`: each page-taker's place over the whole run, in step then batch order, the order
    of `pages`); the others continue the row's last page."""
    continued = last + positions - lengths + 1
    if not len(pages):  # no page opened (or taken) yet: every position continues its row's last page
        return continued
    opened_at = positions - offset - lengths  # the run step that opened the position's page (< 0: before)
    return np.where(opened_at >= 0, pages[taker[np.maximum(opened_at, 0), cols]] * page_size + offset, continued)


class PagedRun:
    """A run of decode steps at page size > 1 whose batch loses requests as it goes, planned
    once (every position, page-taker and slot of the run's start batch; `present[s, i]`) and
    taken in pieces: `take(last)` takes the pages the steps up to `last` open, from the free
    list as it is then (after any release before it); `write(cols, steps)` writes the first
    `steps` steps' slots of the requests at `cols` into their rows. A request that leaves is
    written before its release (which reads its row), the rest once, when the run ends."""

    def __init__(self, allocator: "PagedTokenToKVPoolAllocator", lengths: np.ndarray, rows: np.ndarray,
                 table: np.ndarray, present: np.ndarray):
        ps, steps = allocator.page_size, present.shape[0]
        self.allocator, self.rows, self.table, self.lengths = allocator, rows, table, lengths
        self.positions = lengths + np.arange(steps, dtype=np.int64)[:, None]  # (steps, bs)
        self.offset = self.positions % ps
        opens = present & (self.offset == 0)
        self.opened = np.count_nonzero(opens, axis=1)  # the pages each step opens
        self.through = np.cumsum(self.opened).tolist()  # the run's pages up to each step
        self.taker = np.cumsum(opens.reshape(-1)).reshape(opens.shape) - 1  # each page-taker's place
        self.last = table[rows, np.maximum(lengths - 1, 0)].astype(np.int64)  # before the run writes
        self.pages = np.empty(self.through[-1] if steps else 0, dtype=np.int64)
        self.taken = 0

    def take(self, last: int) -> None:
        """The pages of the steps up to `last` (1-based) not taken yet."""
        end = self.through[last - 1]
        self.allocator.take_run_pages(self.pages[self.taken : end])
        self.taken = end

    def write(self, cols: np.ndarray, steps: int) -> None:
        """Rows of the requests at `cols` (indices into the run's start batch): positions of
        the run's first `steps` steps, whose pages must be taken."""
        if not steps or not len(cols):
            return
        positions = self.positions[:steps, cols]
        self.table[self.rows[cols], positions] = _run_slot_values(
            positions, self.offset[:steps, cols], self.lengths[cols], self.last[cols], self.taker, cols,
            self.pages[: self.taken], self.allocator.page_size)


def make_allocator(size: int, page_size: int, device: torch.device, backend: str,
                   need_sort: bool = False, debug: bool = False) -> BaseAllocator:
    if page_size == 1:
        return TokenToKVPoolAllocator(size, device, backend, need_sort, debug)
    return PagedTokenToKVPoolAllocator(size, page_size, device, backend, need_sort, debug)
