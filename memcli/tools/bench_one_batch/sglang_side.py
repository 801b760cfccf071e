"""`bench-one-batch --compare sglang-0.5.5`: SGLang 0.5.5's own memory path, timed beside memcli's.

The reference loader (`memcli.reference`) imports SGLang's real allocators, request pool,
prefix caches, `ScheduleBatch` and `mem_cache.common` from the cached wheel. For every case
this module builds SGLang's stack at the same sizes, runs the same static batch (same
prompts, same cached prefix, same decode steps) and times the same three phases with the
same statistics (`phases.measure`, `repeat` calls per round):

    prefill_memory   common.alloc_for_extend(batch)              (rows, KV slots, req_to_token)
    decode_memory    common.alloc_for_decode(batch, 1), each step (median over the steps)
    free             cache_finished_req of every request, in one free group

SGLang runs with the attention backend its server picks by default on the device
(`memcli.reference.backends`: fa3 on an H100 or H200, so `support_triton()` holds and
`write_cache_indices` launches `write_req_to_token_pool_triton`; torch_native on a CPU), or the
one `--compare-backend` names. Only the memory stack is SGLang's: its KV pool is a one-layer stand-in of one 1-wide head
(the allocators only keep a reference to it). The tree cache is SGLang's `RadixCache` for
`--tree-cache radix` and its `ChunkCache` otherwise (the cache SGLang runs when the radix
cache is disabled; its bench's three-attribute namespace has no free path to time).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np
import torch
import triton

from memcli.config import Config
from memcli.errors import MemcliError
from memcli.reference.backends import BackendChoice, choose_backend
from memcli.reference.loader import Reference
from memcli.reference.standins import ModelConfig, NoSpeculation
from memcli.tools.bench_one_batch.cases import Case
from memcli.tools.bench_one_batch.phases import PhaseTiming, combine_steps, measure, measure_beside
from memcli.tools.bench_one_batch.runner import VOCAB_SIZE, case_tokens

NAME = "sglang-0.5.5"

# SGLang's paged `alloc_extend_kernel` takes the next power of two of the batch's new tokens
# as a block size (a constexpr): from this size on, its first compile is slow (minutes in
# ptxas at 524,288 on an H200 host), and on a CPU its interpreted calls take tenths of seconds.
SLOW_EXTEND_BLOCK = 65536


def slow_start_notes(cases: list[Case], device_type: str) -> list[str]:
    """What to expect from SGLang's side before it runs: its paged extend kernel, sized to the
    largest batch (a user who sees minutes of silence should know it is not hung)."""
    paged = [c for c in cases if c.page_size > 1]
    if not paged:
        return []
    block = max(triton.next_power_of_2(c.batch_size * (c.input_len - c.prefix_len)) for c in paged)
    if device_type == "cuda":
        if block < SLOW_EXTEND_BLOCK:
            return []
        return [f"SGLang's alloc_extend_kernel is compiled for a block of {block:,} tokens (the next power of two"
                " of a batch's new tokens, per page size); at this size its first compile can take minutes, after"
                " which Triton's cache (~/.triton/cache, TRITON_CACHE_DIR) keeps it"]
    return ["SGLang's paged kernels run in Triton's interpreter without CUDA: each of its paged extends takes"
            " milliseconds to seconds (fewer --repeat, or page size 1, for a quick comparison)"]


class SglangComparison:
    """A `run.Comparison`: SGLang's memory path for each case, on the device its kernels use."""

    name = NAME
    setup = ""  # the attention backend names what runs

    def __init__(self, ref: Reference, device: torch.device, backend: Optional[str] = None):
        if torch.device(ref.device).type != device.type:
            raise MemcliError(f"--compare {NAME}: SGLang's pools live on {ref.device}, memcli's on {device.type}",
                              hint="run both on the same device (runtime.device)")
        self.ref = ref
        self.device_type = device.type
        self.backend: BackendChoice = choose_backend(device.type, backend)

    def slow_start_notes(self, cases: list[Case]) -> list[str]:
        return slow_start_notes(cases, self.device_type)

    def check_case(self, case: Case, mine: Any) -> None:
        return None  # the slot counts are checked by the idle checks of both sides

    def run_case(self, case: Case, config: Config, options, floor=None) -> dict[str, PhaseTiming]:
        """SGLang's side of one case; with a `floor` (`rounds.GraphFloor`), each decode step's
        memory path is timed in turn with the launch floor, as memcli's is."""
        self.ref.use_attention_backend(self.backend.name)
        runner = SglangCase(self.ref, case, config, seed=options.seed)
        timed = functools.partial(measure, device=runner.device, repeat=options.repeat, warmup=options.warmup)
        runner.start()
        phases = {"prefill_memory": timed(runner.prefill_memory, setup=runner.restore_prefill)}
        runner.prefill()
        steps, floors = [], []
        for _ in range(runner.decode_steps):
            restore = functools.partial(runner.restore_decode, runner.snapshot_decode())
            memory, launch = measure_beside(runner.decode_memory, None if floor is None else floor.replay,
                                            runner.device, options.repeat, options.warmup, setup=restore)
            steps.append(memory)
            if launch is not None:
                floors.append(launch)
            runner.decode_step()
        if steps:
            phases["decode_memory"] = combine_steps(steps)
        if floors:
            phases["launch_floor"] = combine_steps(floors)
        phases["free"] = timed(runner.finish, setup=runner.before_finish)
        return phases


class SglangCase:
    """One static batch through SGLang's stack; the same life as `runner.CaseRunner`."""

    def __init__(self, ref: Reference, case: Case, config: Config, seed: int = 0):
        self.ref, self.case = ref, case
        self.device = torch.device(ref.device)
        ps, size = case.page_size, config.pool_size
        kv_pool = ref.tiny_kv_pool(size, ps)
        if ps == 1:
            self.allocator = ref.TokenToKVPoolAllocator(size, torch.int64, ref.device, kv_pool, False)
        else:
            self.allocator = ref.PagedTokenToKVPoolAllocator(size, ps, torch.int64, ref.device, kv_pool, False)
        self.pool = ref.ReqToTokenPool(config.memory.max_running_requests, config.memory.max_context_len + 4,
                                       ref.device, enable_memory_saver=False)
        if config.cache.kind == "radix":
            self.tree_cache = ref.RadixCache(self.pool, self.allocator, ps,
                                             eviction_policy=config.cache.eviction_policy)
        else:
            self.tree_cache = ref.ChunkCache(self.pool, self.allocator, ps)
        minus_one = config.behaviour.bench_decode_steps == "output_len_minus_1"
        self.decode_steps = max(case.output_len - minus_one, 0)
        # The prompts of `runner.CaseRunner`: the same tokens for the same case and seed.
        self.prompts = case_tokens(case, seed)[:, : case.input_len]
        self.batch: Any = None
        self._before_prefill: Any = None
        self._rows_before_prefill: list[int] = []
        self._before_finish: Any = None

    # -- start: idle stack -> before prefill ------------------------------------------------
    def _req(self, rid: str, prompt: np.ndarray) -> Any:
        params = self.ref.SamplingParams(max_new_tokens=max(self.case.output_len, 1))
        params.normalize(None)
        return self.ref.Req(rid, "", prompt.tolist(), params, vocab_size=ModelConfig.vocab_size)

    def _batch(self, reqs: list) -> Any:
        return self.ref.ScheduleBatch.init_new(reqs, self.pool, self.allocator, self.tree_cache, ModelConfig(),
                                               False, NoSpeculation())

    def start(self) -> None:
        """Idle stack, prefix warmed, batch built (its prefill not yet run)."""
        self.allocator.clear()
        self.pool.clear()
        if hasattr(self.tree_cache, "reset"):
            self.tree_cache.reset()
        prefixes = self._warm_prefix()
        reqs = [self._req(str(i), self.prompts[i]) for i in range(self.case.batch_size)]
        for req, prefix in zip(reqs, prefixes):
            req.init_next_round_input(self.tree_cache)
            if prefix is not None:
                req.prefix_indices = prefix
                req.extend_input_len = len(req.fill_ids) - len(prefix)
            self.tree_cache.inc_lock_ref(req.last_node)
        self.pool.clear()
        self.batch = self._batch(reqs)
        self._before_prefill = self.allocator.backup_state()
        self._rows_before_prefill = list(self.pool.free_slots)

    def _warm_prefix(self) -> list[Optional[torch.Tensor]]:
        """Prefill every request's prefix once: inserted into the radix tree, or handed over
        as each request's `prefix_indices` (a prior allocation) with the chunk cache."""
        n, bs = self.case.prefix_len, self.case.batch_size
        if n == 0:
            return [None] * bs
        warm = [self._req(f"warm-{i}", self.prompts[i, :n]) for i in range(bs)]
        for req in warm:
            req.init_next_round_input(self.tree_cache)
        self._batch(warm).prepare_for_extend()
        if self.case_uses_radix:
            self.allocator.free_group_begin()
            for req in warm:
                self.tree_cache.cache_finished_req(req)
            self.allocator.free_group_end()
            return [None] * bs
        prefixes = [self.pool.req_to_token[req.req_pool_idx, :n].to(torch.int64) for req in warm]
        self.pool.free([req.req_pool_idx for req in warm])
        return prefixes

    @property
    def case_uses_radix(self) -> bool:
        return isinstance(self.tree_cache, self.ref.RadixCache)

    # -- prefill ----------------------------------------------------------------------------
    def prefill_memory(self) -> None:
        """SGLang's memory path of the prefill alone (needs the fields of one `prefill()`)."""
        self.ref.common.alloc_for_extend(self.batch)

    def restore_prefill(self) -> None:
        self.allocator.restore_state(self._before_prefill)
        self.pool.free_slots = list(self._rows_before_prefill)
        if self.batch.seq_lens is None:  # the first call: prepare_for_extend sets the batch's fields
            self.batch.prepare_for_extend()
            self.allocator.restore_state(self._before_prefill)
            self.pool.free_slots = list(self._rows_before_prefill)
        for req in self.batch.reqs:
            req.req_pool_idx = None

    def prefill(self) -> None:
        """From before the prefill: the whole `prepare_for_extend` (leaves the batch after it)."""
        self.restore_prefill()
        self.batch.prepare_for_extend()
        self._sample()

    def _sample(self) -> None:
        """The token each request samples (fresh ids; only their count matters to memory)."""
        bs = len(self.batch.reqs)
        self.batch.output_ids = torch.arange(bs, dtype=torch.int64, device=self.device) + VOCAB_SIZE
        for req in self.batch.reqs:
            req.output_ids.append(VOCAB_SIZE)

    # -- decode -----------------------------------------------------------------------------
    def decode_memory(self) -> None:
        self.ref.common.alloc_for_decode(self.batch, token_per_req=1)

    def snapshot_decode(self) -> Any:
        return self.allocator.backup_state()

    def restore_decode(self, state: Any) -> None:
        self.allocator.restore_state(state)

    def decode_step(self) -> None:
        self.batch.prepare_for_decode()
        self._sample()

    # -- finish -----------------------------------------------------------------------------
    def before_finish(self) -> None:
        """Setup of `finish`, as memcli's runner does it: with the chunk cache, whose finish
        only frees, a snapshot (free lists, request rows, its protected count) puts the batch
        back; the radix cache's finish inserts into the tree, so the case is run again from an
        idle stack."""
        if self.case_uses_radix:
            self.replay_to_finish()
        elif self._before_finish is None:
            self._before_finish = (self.allocator.backup_state(), list(self.pool.free_slots),
                                   self.tree_cache.protected_size_)
        else:
            state, rows, protected = self._before_finish
            self.allocator.restore_state(state)
            self.pool.free_slots = list(rows)
            self.tree_cache.protected_size_ = protected

    def finish(self) -> None:
        """Every request released through SGLang's own finish path, in one free group."""
        self.allocator.free_group_begin()
        for req in self.batch.reqs:
            self.tree_cache.cache_finished_req(req)
        self.allocator.free_group_end()

    def replay_to_finish(self) -> None:
        """From an idle stack, the case up to its finish (untimed setup of `finish`)."""
        self.start()
        self.prefill()
        for _ in range(self.decode_steps):
            self.decode_step()
