"""`CaseRunner`: one static batch driven through the real stack, phase by phase.

The life of a case, and the state each phase starts from:

    start()            reset the stack, warm the prefix, build the requests    -> before prefill
    prefill()          prepare_for_extend (+ KV store of the new tokens)       -> after prefill
    decode_step()      prepare_for_decode (+ KV store of one token each)       -> one step later
    finish()           release every request                                   -> idle

Timed phases are repeated from the same state: `restore_prefill()` and `restore_decode()` put
back a snapshot (allocator free list, request rows, request and batch fields); `finish` is
repeated from a snapshot too with the null cache, and after `replay_to_finish()` (the case
run again from an idle stack) with the radix and chunk caches, whose finish cannot be undone.

Prefix: with the radix cache, a warm-up prefill of each request's first `prefix_len` tokens
is inserted into the tree, and the measured requests match it. With the chunk or null cache
nothing is shared, so the measured requests receive the slots of that warm-up prefill as
their `prefix_indices` (a prior allocation) and own them from then on.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from memcli.tools.bench_one_batch.cases import Case
from memcli import engines
from memcli.errors import MemcliError
from memcli.timing import wall_time

VOCAB_SIZE = 10_000


def case_tokens(case: Case, seed: int) -> np.ndarray:
    """The token ids of every request of `case` (prompt, then outputs), from `seed`. Each row
    starts with a distinct token, so requests share no prefix."""
    tokens = np.random.default_rng(seed).integers(0, VOCAB_SIZE, (case.batch_size, case.seq_len), dtype=np.int64)
    tokens[:, 0] = np.arange(case.batch_size)
    return tokens


class DecodeSnapshot(NamedTuple):
    """What a decode step changes: the free list, the batch's lengths, each request's slots."""

    allocator: Any  # the memory manager's snapshot
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    kv_allocated_lens: list[int]


class CaseRunner:
    """Drives `case` on `stack` (built with the case's page size). Mutates the stack."""

    def __init__(self, stack: Any, case: Case, seed: int = 0):
        self.stack = stack
        self.memory = stack.memory
        self.engine = engines.get(stack.config)
        if self.engine.make_batch is None:
            raise MemcliError(f"engine {self.engine.name} has no static batch to bench",
                              "bench-one-batch runs an engine with a static batch: --engine sglang-0.5.5")
        self.case = case
        self.device = stack.device
        self.store_kv = False  # set by alloc_kv_sources()
        self.prefix_lens: list[int] = []  # each request's cached prefix, set by start()
        # SGLang's bench runs output_len - 1 decode steps (its prefill samples the first token).
        minus_one = stack.config.behaviour.bench_decode_steps == "output_len_minus_1"
        self.decode_steps = max(case.output_len - minus_one, 0)
        tokens = case_tokens(case, seed)
        self.prompts = tokens[:, : case.input_len]
        self.outputs = tokens[:, case.input_len :]
        self.batch: Any = None  # the engine's static batch
        self._before_prefill: Any = None
        self.in_use_before_prefill = 0  # allocator tokens in use when the prefill starts
        self._released = False
        self._before_finish: Any = None
        self._k_new = self._v_new = None
        self._k_decode = self._v_decode = None
        self.warm_prefill_s: Optional[float] = None  # wall time of the prefix warm-up's prefill

    @property
    def reqs(self) -> list:
        return self.batch.reqs

    # -- start: idle stack -> before prefill ------------------------------------------------
    def start(self) -> None:
        """Reset the stack (no request may hold memory), warm the prefix, build the batch."""
        self.stack.reset()
        prefixes = self._warm_prefix()
        make_req = self.engine.make_req
        reqs = [make_req(str(i), self.prompts[i], self.case.output_len, self.device) for i in range(self.case.batch_size)]
        memory = self.memory
        for req, prefix in zip(reqs, prefixes):
            req.init_next_round_input(memory)
            if prefix is not None:
                memory.adopt_prefix(req, prefix)
                req.extend_input_len = len(req.fill_ids) - len(prefix)
            memory.lock(req.last_node)
        # Each request's cached prefix at admission (a release may rewrite `prefix_indices`:
        # SGLang 0.5.23's checkpoint points it at the tree's slots of the whole row).
        self.prefix_lens = [len(r.prefix_indices) for r in reqs]
        # The warm-up rows are all free again: start from the table's initial row order, so
        # that every prefill (first, timed or replayed) gets the same rows.
        memory.clear_rows()
        self.batch = self._batch(reqs)
        self._released = False
        self._before_prefill = memory.snapshot()
        self.in_use_before_prefill = memory.in_use_tokens

    def _warm_prefix(self) -> list[Optional[torch.Tensor]]:
        """Prefill every request's prefix once; return the prefix slots to hand over (or Nones)."""
        n, bs = self.case.prefix_len, self.case.batch_size
        if n == 0:
            return [None] * bs
        warm = [self.engine.make_req(f"warm-{i}", self.prompts[i, :n], 0, self.device) for i in range(bs)]
        for req in warm:
            req.init_next_round_input(None)
        memory = self.memory
        self.warm_prefill_s = wall_time(self._batch(warm).prepare_for_extend, self.device)
        if memory.sharing:
            memory.commit_allocated(warm)
            with memory.free_group():
                for req in warm:
                    memory.release(req)
            return [None] * bs
        for req in warm:
            memory.cache_unfinished(req)
            memory.free_row(req)
        return [req.prefix_indices for req in warm]

    # -- prefill ----------------------------------------------------------------------------
    def prefill(self) -> None:
        """prepare_for_extend, then the KV store of every new token (when the pool is real)."""
        self._extend()
        if self.store_kv:
            self.store_prefill_kv()

    def _batch(self, reqs: list) -> Any:
        return self.engine.make_batch(reqs, self.memory, self.stack.config)

    def _extend(self) -> None:
        """The batch's extend; raises `OutOfMemoryError` (with the numbers) when it does not fit."""
        if not self.batch.prepare_for_extend():
            self.memory.require_extend(self.batch.extend_plan)  # fails as the batch did, and says why

    def prefill_memory(self) -> None:
        """The memory path alone: request rows, KV slots, write_cache_indices.

        Needs the extend plan of an earlier `prefill()`; leaves the request fields unset.
        """
        self.memory.require_extend(self.batch.extend_plan)

    def restore_prefill(self) -> None:
        """Back to the state `start()` left: rows and slots of the prefill given back."""
        self.memory.restore(self._before_prefill, self.reqs)

    def store_prefill_kv(self) -> None:
        self.memory.store_kv(self.batch.out_cache_loc, self._k_new, self._v_new)

    def copy_prefill_kv(self) -> None:
        """A plain device copy of as many bytes as `store_prefill_kv` writes (the bandwidth
        baseline): K into V, then V into K, both contiguous, so each is one memcpy."""
        self._v_new.copy_(self._k_new)
        self._k_new.copy_(self._v_new)

    @property
    def new_tokens(self) -> int:
        """Tokens the prefill computes (and stores), over the batch."""
        return sum(len(r.fill_ids) - prefix for r, prefix in zip(self.reqs, self.prefix_lens))

    def alloc_kv_sources(self) -> None:
        """K/V of the new tokens for every layer (prefill) and of one token per request (decode);
        from now on `prefill` and `decode_step` store them. Needs a materialized pool."""
        kv = self.stack.kv_pool
        if not kv.materialized:
            raise ValueError("the KV pool is not materialized (memory.kv_pool: indices): nothing to store into")
        self.store_kv = True
        shape = (kv.num_layers, self.new_tokens, kv.num_kv_heads, kv.head_dim)
        self._k_new = torch.empty(shape, dtype=kv.dtype, device=self.device)
        self._v_new = torch.empty(shape, dtype=kv.dtype, device=self.device)
        shape = (kv.num_layers, self.case.batch_size, kv.num_kv_heads, kv.head_dim)
        self._k_decode = torch.empty(shape, dtype=kv.dtype, device=self.device)
        self._v_decode = torch.empty(shape, dtype=kv.dtype, device=self.device)

    def free_kv_sources(self) -> None:
        self.store_kv = False
        self._k_new = self._v_new = self._k_decode = self._v_decode = None

    # -- decode -----------------------------------------------------------------------------
    def decode_step(self) -> None:
        """prepare_for_decode, then the KV store of the new token of every request."""
        self.batch.prepare_for_decode()
        if self.store_kv:
            self.store_decode_kv()

    def decode_memory(self) -> None:
        """The memory path alone: one slot per request, written into req_to_token."""
        b = self.batch
        self.memory.alloc_decode(None, seq_lens=b.seq_lens, seq_lens_cpu=b.seq_lens_cpu,
                                 req_pool_indices=b.req_pool_indices, num_pages=b.decode_pages_needed(b.page_size))

    def store_decode_kv(self) -> None:
        self.memory.store_kv(self.batch.out_cache_loc, self._k_decode, self._v_decode)

    def snapshot_decode(self) -> DecodeSnapshot:
        b = self.batch
        # A copy of the device lengths: a decode step's graph replay increments them in place.
        return DecodeSnapshot(self.memory.snapshot(), b.seq_lens.clone(), b.seq_lens_cpu,
                              [r.kv_allocated_len for r in self.reqs])

    def restore_decode(self, snap: DecodeSnapshot) -> None:
        """Back to the snapshot. The lengths are written into the batch's own tensor, as a
        running batch keeps them from one step to the next (a graph replay finds them in its
        buffer, as in a steady decode loop)."""
        self.memory.restore(snap.allocator, self.reqs, snap.kv_allocated_lens)
        self.batch.seq_lens.copy_(snap.seq_lens)
        self.batch.seq_lens_cpu = snap.seq_lens_cpu

    # -- finish -----------------------------------------------------------------------------
    def finish(self) -> None:
        """Release every request (their K/V counts as computed: the tree caches it)."""
        self.memory.release_all(self.reqs, self.batch.req_pool_indices)
        self._released = True

    def before_finish(self) -> None:
        """Setup of `finish`: the running batch the first time, the same batch again after.

        The null cache keeps no state per request, so a snapshot (free list, rows, request
        flags) restores the batch; the other caches record the finish (tree insertion,
        held-token counts), so the case is replayed from an idle stack.
        """
        if not self._released:
            self.ready_to_finish()
            self._before_finish = self.memory.snapshot() if self.memory.keeps_no_request_state else None
        elif self._before_finish is not None:
            self._restore_finish(self._before_finish)
        else:
            self.replay_to_finish()

    def _restore_finish(self, state: Any) -> None:
        # The prefill took its rows right after a clear(); taking them again gives the same ones.
        self.memory.restore(state, self.reqs, [req.kv_allocated_len for req in self.reqs])
        self.memory.retake_rows(self.reqs)
        self._released = False

    def ready_to_finish(self) -> None:
        """Mark every allocated token as computed and give each request its output tokens."""
        for req, out in zip(self.reqs, self.outputs):
            req.output_ids = out.tolist()
        self.memory.commit_allocated(self.reqs)

    def replay_to_finish(self) -> None:
        """From an idle stack, run the case's memory path up to the finish (untimed setup)."""
        self.start()
        self._extend()
        for _ in range(self.decode_steps):
            self.batch.prepare_for_decode()
        self.ready_to_finish()
