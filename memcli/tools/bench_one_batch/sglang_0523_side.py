"""`bench-one-batch --compare sglang-0.5.23`: SGLang 0.5.23's own `allocation.py` paths, timed beside memcli's.

SGLang 0.5.23's modules are imported in this process from the cached wheel
(`memcli.reference.v0523.loader`: its real `allocation.py`, allocators, pools,
`ReqToTokenPool`, `Req`, `ScheduleBatch` and `UnifiedRadixCache`, behind the documented
stand-ins). The tree runs on its Python core (`tree_core_backend="python"`): the allocation
paths never call the compiled Rust core, so only the wheel's Python files are needed, and a
Python the wheel has no build for can time them. Per case, the same three phases as for 0.5.5
(`phases.measure`, `repeat` calls per round):

    prefill_memory   allocation.alloc_for_extend(batch)               (rows, KV slots, req_to_token)
    decode_memory    allocation.alloc_for_decode(batch, 1), each step  (median over the steps)
    free             common.release_kv_cache(req, tree, checkpoint=True) of every request, in one free group

The attention backend is the one SGLang's server picks on the device (`memcli.reference.backends`:
fa3 on an H200, so `write_req_to_token_pool_triton` and the paged Triton kernels run; torch_native
on a CPU), or `--compare-backend`. The tree is `UnifiedRadixCache` (0.5.23 has no `ChunkCache`):
with `--tree-cache radix` a case's prefix is matched in it; otherwise it is built disabled (what
`--disable-radix-cache` builds) and a case's prefix is the request's own earlier allocation, held
in its row (how 0.5.23 extends a request whose prefix it already holds, as in a later chunk). The
slots taken by prefill and decode, the slots freed and the rows held are checked against memcli's
figures case by case (`check_case`).
"""

from __future__ import annotations

import copy
import functools
import importlib
from array import array
from types import SimpleNamespace
from typing import Any, NamedTuple, Optional

import torch

from memcli.config import Config
from memcli.errors import IntegrityError, MemcliError
from memcli.reference.backends import BackendChoice, choose_backend
from memcli.tools.bench_one_batch.cases import Case
from memcli.tools.bench_one_batch.phases import PhaseTiming, combine_steps, measure, measure_beside
from memcli.tools.bench_one_batch.results import CaseResult
from memcli.tools.bench_one_batch.runner import VOCAB_SIZE, case_tokens
from memcli.tools.bench_one_batch.sglang_side import slow_start_notes

NAME = "sglang-0.5.23"
SETUP = ("SGLang 0.5.23's allocation.py, allocators, ReqToTokenPool, Req, ScheduleBatch and UnifiedRadixCache"
         " (Python tree core) from its wheel, loaded in this process behind memcli's stand-ins")
# Allocator fields a call of the allocation paths reassigns (never mutates in place).
ALLOCATOR_STATE = ("free_pages", "release_pages", "free_group", "free_page_ids_group", "staged_pages",
                   "num_staged_pages")


class Figures(NamedTuple):
    """What one run of a case took and gave back, in tokens and rows."""

    prefill_tokens: int
    decode_tokens: int
    freed_tokens: int
    rows_held: int


class Sglang0523Comparison:
    """A `run.Comparison`: SGLang 0.5.23's memory path for each case, on memcli's device."""

    name = NAME
    setup = SETUP

    def __init__(self, ref: Any, device: torch.device, backend: Optional[str] = None):
        self.ref = ref
        self.device_type = device.type
        self.backend: BackendChoice = choose_backend(device.type, backend)
        self.figures: dict[Case, Figures] = {}

    def slow_start_notes(self, cases: list[Case]) -> list[str]:
        return slow_start_notes(cases, self.device_type)

    def check_case(self, case: Case, mine: CaseResult) -> None:
        """Raise `IntegrityError` when SGLang's last run of `case` took or freed other slots,
        or held another number of rows, than memcli's."""
        got = self.figures[case]
        want = Figures(mine.prefill_allocated_tokens, mine.decode_allocated_tokens, mine.freed_tokens,
                       case.batch_size)
        if got != want:
            differ = [f"{name} {a} (SGLang) vs {b} (memcli)" for name, a, b in zip(Figures._fields, got, want)
                      if a != b]
            raise IntegrityError(f"--compare {NAME}, case {case.label}: SGLang and memcli did different work:"
                                 f" {'; '.join(differ)}")

    def run_case(self, case: Case, config: Config, options, floor=None) -> dict[str, PhaseTiming]:
        """SGLang 0.5.23's side of one case (its decode timed in turn with `floor`, as memcli's is)."""
        runner = Sglang0523Case(self.ref, case, config, self.device_type, self.backend.name, options.seed)
        timed = functools.partial(measure, device=runner.device, repeat=options.repeat, warmup=options.warmup)
        runner.start()
        phases = {"prefill_memory": timed(runner.prefill_memory, setup=runner.restore_prefill)}
        prefill_tokens = runner.prefill()
        rows_held = runner.rows_held()
        steps, floors, decode_tokens = [], [], 0
        for _ in range(runner.decode_steps):
            restore = functools.partial(runner.restore_decode, runner.snapshot())
            memory, launch = measure_beside(runner.decode_memory, None if floor is None else floor.replay,
                                            runner.device, options.repeat, options.warmup, setup=restore)
            steps.append(memory)
            if launch is not None:
                floors.append(launch)
            decode_tokens += runner.decode_step()
        if steps:
            phases["decode_memory"] = combine_steps(steps)
        if floors:
            phases["launch_floor"] = combine_steps(floors)
        phases["free"] = timed(runner.finish, setup=runner.replay_to_finish)
        self.figures[case] = Figures(prefill_tokens, decode_tokens, runner.freed(), rows_held)
        return phases


def load_comparison(device: torch.device, backend: Optional[str] = None) -> Sglang0523Comparison:
    """SGLang 0.5.23 loaded in this process (`MemcliError` with the reason when it cannot be)."""
    from memcli.reference.fetch import SGLANG_0523, ReferenceFetchError
    from memcli.reference.v0523.loader import load_reference_0523

    if importlib.util.find_spec("msgspec") is None:
        raise MemcliError(f"--compare {NAME}: msgspec is not installed (SGLang {SGLANG_0523} builds on it)",
                          hint="pip install msgspec (memcli's [test] extra has it)")
    try:
        ref = load_reference_0523()
    except ReferenceFetchError as exc:
        raise MemcliError(f"--compare {NAME}: the sglang {SGLANG_0523} wheel is not available: {exc.message}",
                          hint="fetch it once with `memcli reference fetch` where PyPI is reachable (MEMCLI_CACHE_DIR"
                               " moves the cache)") from exc
    return Sglang0523Comparison(ref, device, backend)


def publish_bench_args(ref: Any, page_size: int, backend: str, device_type: str) -> None:
    """SGLang's own `ServerArgs` for this run (the attention backend its allocation paths read)."""
    args = ref.server_args.ServerArgs(model_path="dummy", page_size=page_size, attention_backend=backend,
                                      device=device_type)
    ref.runtime_context.get_context().set_server_args(args)


class Sglang0523Case:
    """One static batch through SGLang 0.5.23's stack; the same life as `runner.CaseRunner`."""

    def __init__(self, ref: Any, case: Case, config: Config, device_type: str, backend: str, seed: int = 0):
        self.ref, self.case, self.config = ref, case, config
        self.device = torch.device(device_type)
        self.backend = backend
        minus_one = config.behaviour.bench_decode_steps == "output_len_minus_1"
        self.decode_steps = max(case.output_len - minus_one, 0)
        self.prompts = case_tokens(case, seed)[:, : case.input_len]
        self.radix = config.cache.kind == "radix"
        self.model_config = SimpleNamespace(vocab_size=VOCAB_SIZE, is_encoder_decoder=False, hidden_size=64,
                                            is_matryoshka=False, attention_chunk_size=None)
        self.spec = importlib.import_module("sglang.srt.speculative.spec_info").SpeculativeAlgorithm.NONE
        self.params = importlib.import_module("sglang.srt.sampling.sampling_params").SamplingParams
        self.batch: Any = None
        self._before_prefill: Any = None
        self._in_use_before_finish = 0
        self._build()

    def _build(self) -> None:
        ref, ps, size = self.ref, self.case.page_size, self.config.pool_size
        publish_bench_args(ref, ps, self.backend, self.device.type)
        kv_pool = ref.MHATokenToKVPool(size, ps, torch.float32, 1, 1, 1, self.device.type, enable_memory_saver=False,
                                       enable_alt_stream=False)
        if ps == 1:
            self.allocator = ref.TokenToKVPoolAllocator(size, torch.int64, self.device.type, kv_pool, False)
        else:
            self.allocator = ref.PagedTokenToKVPoolAllocator(size, ps, torch.int64, self.device.type, kv_pool, False)
        mem = self.config.memory
        self.pool = ref.ReqToTokenPool(size=mem.max_running_requests, max_context_len=mem.max_context_len + 4,
                                       device=self.device.type, enable_memory_saver=False)
        full = ref.unified_radix_cache.ComponentType.FULL
        params = ref.CacheInitParams(disable=not self.radix, req_to_token_pool=self.pool,
                                     token_to_kv_pool_allocator=self.allocator, page_size=ps, tree_components=(full,),
                                     eviction_policy=self.config.cache.eviction_policy, tree_core_backend="python")
        self.tree = ref.UnifiedRadixCache(params)

    # -- state ------------------------------------------------------------------------------
    def snapshot(self) -> tuple:
        """The allocator's free lists, the free rows and every request's KV record."""
        state = {name: copy.copy(getattr(self.allocator, name)) for name in ALLOCATOR_STATE
                 if hasattr(self.allocator, name)}
        reqs = self.batch.reqs if self.batch is not None else []
        return state, list(self.pool.free_slots), [copy.copy(r.kv) for r in reqs]

    def restore(self, snap: tuple) -> None:
        state, rows, kvs = snap
        for name, value in state.items():
            setattr(self.allocator, name, copy.copy(value))
        self.pool.free_slots = list(rows)
        for req, kv in zip(self.batch.reqs, kvs):
            req.kv = copy.copy(kv)

    def rows_held(self) -> int:
        return len({int(r.kv.req_pool_idx) for r in self.batch.reqs if r.kv.req_pool_idx is not None})

    # -- start: idle stack -> before prefill ------------------------------------------------
    def _req(self, rid: str, prompt) -> Any:
        params = self.params(max_new_tokens=max(self.case.output_len, 1))
        params.normalize(None)
        return self.ref.Req(rid, "", array("q", prompt.tolist()), params, vocab_size=VOCAB_SIZE)

    def _admit(self, reqs: list, extend_end: Optional[int] = None) -> Any:
        """What `PrefillAdder` does to a request it takes whole: its extent set, its prefix locked."""
        for req in reqs:
            req.init_next_round_input(self.tree)
            req.extend_end = extend_end or len(req.full_untruncated_fill_ids)
            req.lock = self.tree.lock(req.last_node)
        return self.ref.ScheduleBatch.init_new(reqs, self.pool, self.allocator, self.tree, self.model_config, False,
                                               self.spec)

    def start(self) -> None:
        """Idle stack, prefix in place, batch built (its prefill not yet run)."""
        self._build()
        n, bs = self.case.prefix_len, self.case.batch_size
        reqs = [self._req(str(i), self.prompts[i]) for i in range(bs)]
        if n and self.radix:
            warm = [self._req(f"warm-{i}", self.prompts[i, :n]) for i in range(bs)]
            self._admit(warm).prepare_for_extend()
            self._release(warm)
        if n and not self.radix:  # the request's own earlier allocation of its prefix, held in its row
            self._admit(reqs, extend_end=n).prepare_for_extend()
            for req in reqs:
                req.prefix_len, req.extend_end = n, self.case.input_len
            self.batch = self.ref.ScheduleBatch.init_new(reqs, self.pool, self.allocator, self.tree,
                                                         self.model_config, False, self.spec)
        else:
            self.batch = self._admit(reqs)
        self._prepare_fields()
        self._before_prefill = self.snapshot()

    def _prepare_fields(self) -> None:
        """The batch fields `alloc_for_extend` reads, set by one `prepare_for_extend` undone."""
        snap = self.snapshot()
        self.batch.prepare_for_extend()
        self.restore(snap)

    def in_use(self) -> int:
        """Slots not free (held by requests or kept by the tree), as memcli counts them."""
        return self.config.pool_size - self.allocator.available_size()

    # -- prefill ----------------------------------------------------------------------------
    def prefill_memory(self) -> None:
        self.ref.allocation.alloc_for_extend(self.batch)

    def restore_prefill(self) -> None:
        self.restore(self._before_prefill)

    def prefill(self) -> int:
        """From before the prefill: the whole `prepare_for_extend`; the slots it took."""
        self.restore_prefill()
        before = self.in_use()
        self.batch.prepare_for_extend()
        self._sample()
        return self.in_use() - before

    def _sample(self) -> None:
        """The token each request samples (fresh ids; only their count matters to memory)."""
        bs = len(self.batch.reqs)
        self.batch.output_ids = torch.arange(bs, dtype=torch.int64, device=self.device) + VOCAB_SIZE // 2
        for req in self.batch.reqs:
            req.output_ids.append(VOCAB_SIZE // 2)

    # -- decode -----------------------------------------------------------------------------
    def decode_memory(self) -> None:
        self.ref.allocation.alloc_for_decode(self.batch, token_per_req=1)

    def restore_decode(self, snap: tuple) -> None:
        self.restore(snap)

    def decode_step(self) -> int:
        before = self.in_use()
        self.batch.prepare_for_decode()
        self._sample()
        return self.in_use() - before

    # -- finish -----------------------------------------------------------------------------
    def _release(self, reqs: list) -> None:
        self.allocator.free_group_begin()
        for req in reqs:
            self.ref.common.release_kv_cache(req, self.tree, checkpoint=True)
        self.allocator.free_group_end()

    def finish(self) -> None:
        """Every request released through SGLang's own finish path, in one free group."""
        self._release(self.batch.reqs)

    def freed(self) -> int:
        """Slots the last `finish` gave back to the free lists."""
        return self._in_use_before_finish - self.in_use()

    def replay_to_finish(self) -> None:
        """From an idle stack, the case up to its finish (untimed setup of `finish`)."""
        self.start()
        self.prefill()
        for _ in range(self.decode_steps):
            self.decode_step()
        self._in_use_before_finish = self.in_use()
