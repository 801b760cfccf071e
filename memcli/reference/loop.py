"""A model-free reference scheduler: SGLang 0.5.5's non-overlap loop over SGLang's real objects.

`ReferenceLoop.step()` is one iteration of `Scheduler.event_loop_normal`:

    receive arrivals -> get_next_batch_to_run() -> run_batch() + process_batch_result()
                                                 \\-> (no batch) self_check_during_idle()

The loop itself (`get_next_batch_to_run`, `get_new_batch_prefill`, `update_running_batch`,
the memory side of `process_batch_result_prefill/_decode`) is the only part written here,
following `managers/scheduler.py` and `managers/scheduler_output_processor_mixin.py`; every
object it drives is SGLang's own: `Req`, `ScheduleBatch` (`init_new`, `prepare_for_extend`,
`prepare_for_decode`, `retract_decode`, `filter_batch`, `merge_batch`), `PrefillAdder`,
`SchedulePolicy`, `RadixCache`/`ChunkCache`, the allocator and `ReqToTokenPool`.

`memcli.reference.loop_overlap.OverlapReferenceLoop` is the same loop as `event_loop_overlap`
(SGLang's default), chosen by `semantics.event_loop` through `reference_loop()`.

What the loop leaves out (none of it is on by default in SGLang, or it needs a model):
mixed chunked prefill, priority scheduling and preemption, HiCache's storage backends,
LoRA, grammars, PD disaggregation, DP attention, speculative decoding, logprobs, and
stop strings (a request finishes at its `max_new_tokens`, or on `EOS_ID` where the trace
gives a larger `max_new_tokens`), and the abort
of a prompt of `max_req_input_len` tokens or more (the callers refuse such traces first). The host tier
itself (`cache.kind hiradix`, --enable-hierarchical-cache) runs SGLang's `HiRadixCache` with
the scheduler's three hooks (`check_hicache_events` before a prefill is formed, the
`batch_is_full` rule on NO_TOKEN, `ready_to_load_host_cache` before `prepare_for_extend`);
its cache controller is the synchronous stand-in (every copy done when issued).

Settings from a memcli `Config`, as SGLang's server arguments and environment:

    memory.max_total_tokens -> --max-total-tokens (rounded down to pages: `cfg.pool_size`)
    memory.max_running_requests -> --max-running-requests (request rows; batch-full limit)
    memory.max_context_len -> --context-length (request rows of context + 4 columns;
        max_new_tokens clipped to max_req_len - input_len - 1 at arrival)
    scheduler.chunked_prefill_size / max_prefill_tokens / policy -> the server args
    scheduler.init_new_token_ratio -> SGLANG_INIT_NEW_TOKEN_RATIO (schedule_conservativeness 1)
    scheduler.min_new_token_ratio_factor -> SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
    scheduler.new_token_ratio_decay_steps -> SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
    scheduler.retract_decode_steps -> SGLANG_RETRACT_DECODE_STEPS (read at each retraction)
    scheduler.max_new_tokens_clip -> SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION (schedule_policy's
        module constant `CLIP_MAX_NEW_TOKENS`, set for the run)
    cache.kind radix/chunk, cache.eviction_policy lru/lfu -> RadixCache/ChunkCache
    cache.kind hiradix, cache.host_ratio, cache.write_policy -> HiRadixCache with
        --hicache-ratio, --hicache-write-policy (io backend "kernel", layout "layer_first")

Time: the simulated clock advances by memcli's cost model (`memcli.sched.scheduler`), and an
idle iteration with nothing waiting jumps to the next arrival, so that both schedulers see
the same arrivals at the same steps. The radix cache's access times come from a
`LogicalClock` (installed for the loop's lifetime: `close()` restores the previous clock).
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from typing import Any, Optional, Sequence

import torch

from memcli.config import Config
from memcli.errors import IntegrityError, MemcliError
from memcli.mem_cache.clock import LogicalClock
from memcli.reference.loader import Reference, load_reference
from memcli.reference.standins import ModelConfig, NoSpeculation
from memcli.workload.spec import RequestSpec

EOS_ID = ModelConfig.vocab_size - 1  # what a request the trace ends on EOS samples last (its only stop token)

ARRIVALS = ("burst", "timestamp")

# HiRadixCache.load_back_threshold in SGLang 0.5.5 (set in its constructor, not an argument).
SGLANG_LOAD_BACK_THRESHOLD = 10


class ReferenceLoop:
    """SGLang 0.5.5's scheduler loop (non-overlap) over a list of request specs.

    `step()` runs one loop iteration and returns nothing; `observe.observe_reference` reads
    what it did. `run()` steps until every request finished. Raises `IntegrityError` when
    SGLang's own idle leak check fails, and `MemcliError` for a cache kind SGLang's loop
    does not run here (`none`).
    """

    def __init__(self, config: Config, requests: Sequence[RequestSpec], arrivals: str = "burst",
                 output_token_base: int = 1 << 40, ref: Optional[Reference] = None):
        if arrivals not in ARRIVALS:
            raise MemcliError(f'unknown arrivals mode "{arrivals}"', f"use one of: {', '.join(ARRIVALS)}")
        self.ref = ref = ref or load_reference()
        self.config = config
        self.enable_overlap = False  # OverlapReferenceLoop: True (reference_loop() picks by the config)
        self.clock = LogicalClock()
        ref.use_clock(self.clock)
        self._build_stack(config)
        sched = config.scheduler
        self.policy = ref.schedule_policy.SchedulePolicy(sched.policy, self.tree_cache, self.hierarchical, False, False)
        self.server_args = ref.get_global_server_args()
        self.max_prefill_tokens = sched.max_prefill_tokens
        self.chunked_prefill_size = sched.chunked_prefill_size
        self.max_running_requests = config.memory.max_running_requests
        # tp_worker: max_req_len = min(context_len - 1, max_total_num_tokens - 1)
        self.max_req_len = min(config.memory.max_context_len - 1, config.pool_size - 1)
        self.init_new_token_ratio = min(sched.init_new_token_ratio, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * sched.min_new_token_ratio_factor, 1.0)
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / sched.new_token_ratio_decay_steps
        self.new_token_ratio = self.init_new_token_ratio
        self.sim = config.sim
        self.pending: deque[tuple[float, RequestSpec]] = deque(
            (0.0 if arrivals == "burst" else float(spec.arrival_ms or 0.0), spec) for spec in requests)
        self.num_requests = len(requests)
        self.waiting_queue: list = []
        self.running_batch = self._empty_batch()
        self.last_batch = None
        self.chunked_req = None
        self.forward_ct = 0
        self.step_count = 0
        self.clock_ms = 0.0
        self.next_token = output_token_base
        self.finished_rids: list[str] = []
        # What the current step did (read by observe.observe_reference).
        self.step_kind = "idle"
        self.step_batch = None
        self.step_evicted = 0
        self.step_retracted: list[str] = []
        self.step_finished: list[str] = []

    def _build_stack(self, config: Config) -> None:
        ref, ps, size = self.ref, config.page_size, config.pool_size
        kv_pool = ref.tiny_kv_pool(size, ps)
        if ps == 1:
            self.allocator = ref.TokenToKVPoolAllocator(size, torch.int64, ref.device, kv_pool, False)
        else:
            self.allocator = ref.PagedTokenToKVPoolAllocator(size, ps, torch.int64, ref.device, kv_pool, False)
        self.req_to_token_pool = ref.ReqToTokenPool(config.memory.max_running_requests,
                                                    config.memory.max_context_len + 4, ref.device,
                                                    enable_memory_saver=False)
        kind = config.cache.kind
        if kind in ("radix", "hiradix") and config.cache.eviction_policy == "belady":
            raise MemcliError("cache.eviction_policy belady is a memcli extension: SGLang 0.5.5 has no such policy to"
                              " compare with", "use --set cache.eviction_policy=lru or lfu")
        self.hierarchical = kind == "hiradix"
        if kind == "radix":
            self.tree_cache = ref.RadixCache(self.req_to_token_pool, self.allocator, ps,
                                             eviction_policy=config.cache.eviction_policy)
        elif kind == "hiradix":
            self.tree_cache = self._hiradix_cache(config)
        elif kind == "chunk":
            self.tree_cache = ref.ChunkCache(self.req_to_token_pool, self.allocator, ps)
        else:
            raise MemcliError(f"cache.kind {kind} has no SGLang scheduler counterpart",
                              "use --set cache.kind=radix, hiradix or chunk")
        real_evict = self.tree_cache.evict

        def evict(num_tokens: int, *args, **kwargs):
            before = self.tree_cache.evictable_size()
            result = real_evict(num_tokens, *args, **kwargs)
            self.step_evicted += before - self.tree_cache.evictable_size()
            return result

        self.tree_cache.evict = evict
        self.size = size

    def _hiradix_cache(self, config: Config) -> Any:
        """SGLang's `HiRadixCache` (--enable-hierarchical-cache), its host pool sized by
        `cache.host_ratio` (--hicache-ratio), with the synchronous cache controller of
        `memcli.reference.standins`: every copy is finished when it is issued."""
        cache = config.cache
        if cache.host_size_gib is not None:
            raise MemcliError("cache.host_size_gib sizes the host pool by the model's bytes per token, which SGLang's"
                              " side of the diff (a one-layer pool) does not share",
                              "size the host tier with cache.host_ratio (--set cache.host_size_gib=null)")
        if cache.load_back_threshold != SGLANG_LOAD_BACK_THRESHOLD:
            raise MemcliError(f"cache.load_back_threshold is {cache.load_back_threshold}; SGLang 0.5.5's HiRadixCache"
                              f" fixes it at {SGLANG_LOAD_BACK_THRESHOLD}",
                              f"use --set cache.load_back_threshold={SGLANG_LOAD_BACK_THRESHOLD}")
        try:
            return self.ref.hiradix_cache.HiRadixCache(
                self.req_to_token_pool, self.allocator, None, config.page_size, cache.host_ratio, 0,
                cache.write_policy, "kernel", "layer_first", False, eviction_policy=cache.eviction_policy)
        except (AssertionError, ValueError) as exc:  # SGLang's own checks of the host pool's size
            raise MemcliError(f"SGLang's HiRadixCache refuses this host tier: {exc}",
                              "raise cache.host_ratio: SGLang 0.5.5 needs a host pool larger than the device pool,"
                              " in whole pages (semantics.host_pool_floor=any lifts that only on memcli's side)") from exc

    def close(self) -> None:
        """Restore the radix module's clock (the loop installed its own)."""
        self.ref.restore_clock()

    def _empty_batch(self) -> Any:
        return self.ref.ScheduleBatch(reqs=[], batch_is_full=False)

    @contextlib.contextmanager
    def _environment(self):
        """SGLang's environment knobs for the duration of one step."""
        policy_module = self.ref.schedule_policy
        saved_clip, saved_env = policy_module.CLIP_MAX_NEW_TOKENS, os.environ.get("SGLANG_RETRACT_DECODE_STEPS")
        policy_module.CLIP_MAX_NEW_TOKENS = self.config.scheduler.max_new_tokens_clip
        os.environ["SGLANG_RETRACT_DECODE_STEPS"] = str(self.config.scheduler.retract_decode_steps)
        try:
            yield
        finally:
            policy_module.CLIP_MAX_NEW_TOKENS = saved_clip
            if saved_env is None:
                os.environ.pop("SGLANG_RETRACT_DECODE_STEPS", None)
            else:
                os.environ["SGLANG_RETRACT_DECODE_STEPS"] = saved_env

    # -- the loop ---------------------------------------------------------------------------
    def is_done(self) -> bool:
        return len(self.finished_rids) == self.num_requests

    def run(self, max_steps: Optional[int] = None) -> None:
        while not self.is_done() and (max_steps is None or self.step_count < max_steps):
            self.step()

    def step(self) -> None:
        """One iteration of `event_loop_normal`."""
        with self._environment():
            batch = self._launch()
            if batch is not None:
                self.process_batch_result(batch)
            else:
                self.self_check_during_idle()
            self.step_batch = batch
            self.last_batch = batch
        self.step_count += 1

    def _launch(self) -> Optional[Any]:
        """The start of both loops' iteration: arrivals, `get_next_batch_to_run`, `run_batch`.
        Returns the batch run (None: nothing to run)."""
        self.step_evicted, self.step_retracted, self.step_finished = 0, [], []
        self._recv_requests()
        batch = self.get_next_batch_to_run()
        self.step_kind = "idle" if batch is None else "prefill" if batch.forward_mode.is_extend() else "decode"
        if batch is not None:
            self.run_batch(batch)
        return batch

    def _recv_requests(self) -> None:
        while self.pending and self.pending[0][0] <= self.clock_ms:
            _, spec = self.pending.popleft()
            sampling_params = self.ref.SamplingParams(max_new_tokens=spec.sampling_limit, ignore_eos=spec.ignore_eos,
                                                      stop_token_ids=None if spec.eos_len is None else [EOS_ID])
            sampling_params.normalize(None)  # the tokenizer manager's step: no stop strings
            req = self.ref.Req(spec.rid, "", spec.input_ids().tolist(), sampling_params,
                               vocab_size=ModelConfig.vocab_size, extra_key=spec.extra_key)
            req.memcli_eos_len = spec.eos_len  # its output length when it samples EOS_ID (None: never)
            # init_req_max_new_tokens, then _add_request_to_queue (appends)
            req.sampling_params.max_new_tokens = min(req.sampling_params.max_new_tokens,
                                                     self.max_req_len - len(req.origin_input_ids) - 1)
            self._add_request_to_queue(req)

    def _add_request_to_queue(self, req: Any) -> None:
        self.waiting_queue.append(req)
        req.time_stats.wait_queue_entry_time = self.clock_ms

    def get_next_batch_to_run(self) -> Any:
        chunked_req_to_exclude = set()
        if self.chunked_req is not None:
            chunked_req_to_exclude.add(self.chunked_req)
            self.tree_cache.cache_unfinished_req(self.chunked_req, chunked=True)
            self.req_to_token_pool.free(self.chunked_req.req_pool_idx)
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend():
            if last.chunked_req is not None:
                chunked_req_to_exclude.add(last.chunked_req)
            last_bs = last.batch_size()
            last.filter_batch(chunked_req_to_exclude=list(chunked_req_to_exclude))
            if last.batch_size() < last_bs:
                self.running_batch.batch_is_full = False
            if not last.is_empty() and not last.is_prefill_only:
                if self.running_batch.is_empty():
                    self.running_batch = last
                else:
                    self.running_batch.merge_batch(last)
        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if self.running_batch.is_empty():
            return None
        self.running_batch = self.update_running_batch(self.running_batch)
        return None if self.running_batch.is_empty() else self.running_batch

    def get_new_batch_prefill(self) -> Any:
        running = self.running_batch
        if (running.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            return None
        running_bs = len(running.reqs)
        if self.max_running_requests - running_bs <= 0 and self.chunked_req is None:
            running.batch_is_full = True
            return None
        if self.hierarchical:
            self.tree_cache.check_hicache_events()
        self.policy.calc_priority(self.waiting_queue)
        adder = self.ref.schedule_policy.PrefillAdder(
            self.config.page_size, self.tree_cache, self.allocator, running, self.new_token_ratio,
            self.max_prefill_tokens, self.chunked_prefill_size, 0, 0)
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting_queue:
            if len(adder.can_run_list) >= self.max_running_requests - len(running.reqs):
                running.batch_is_full = True
            if running.batch_is_full:
                break
            req.init_next_round_input(self.tree_cache)
            res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None)
            if res != self.ref.schedule_policy.AddReqResult.CONTINUE:
                if res == self.ref.schedule_policy.AddReqResult.NO_TOKEN:
                    # With a host tier, only when something can be served (what runs, or what was admitted).
                    running.batch_is_full = (len(adder.can_run_list) > 0 or not running.is_empty()
                                             if self.hierarchical else True)
                break
        can_run_list = adder.can_run_list
        if not can_run_list:
            return None
        admitted = set(can_run_list)
        self.waiting_queue = [r for r in self.waiting_queue if r not in admitted]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1
        batch = self.ref.ScheduleBatch.init_new(can_run_list, self.req_to_token_pool, self.allocator,
                                                self.tree_cache, ModelConfig(), self.enable_overlap, NoSpeculation(),
                                                chunked_req=self.chunked_req)
        if self.hierarchical:
            batch.hicache_consumer_index = self.tree_cache.ready_to_load_host_cache()
        batch.prepare_for_extend()
        batch.decoding_reqs = None
        return batch

    def update_running_batch(self, batch: Any) -> Any:
        initial_bs = batch.batch_size()
        batch.filter_batch()
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        if not batch.check_decode_mem(1):
            retracted, self.new_token_ratio, _ = batch.retract_decode(self.server_args)
            for req in retracted:
                self.step_retracted.append(req.rid)
                self._add_request_to_queue(req)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        batch.prepare_for_decode()
        return batch

    def run_batch(self, batch: Any) -> None:
        """The simulated forward: advance the clock by memcli's cost model and sample one
        fresh token id per request (none for a request still being chunked after this batch:
        its token is never used)."""
        self.forward_ct += 1
        if batch.forward_mode.is_extend():
            kv_read = sum(batch.prefix_lens)
            self.clock_ms += (self.sim.step_base_ms + self.sim.prefill_token_us * batch.extend_num_tokens / 1e3
                              + self.sim.kv_read_ns * kv_read / 1e6)
            tokens = [0 if req is batch.chunked_req else self._token() for req in batch.reqs]
        else:
            kv_read = int(batch.seq_lens_cpu.sum())
            self.clock_ms += (self.sim.step_base_ms + self.sim.decode_req_us * batch.batch_size() / 1e3
                              + self.sim.kv_read_ns * kv_read / 1e6)
            tokens = [self._token() for _ in batch.reqs]
        batch.output_ids = torch.tensor(tokens, dtype=torch.int64, device=self.ref.device)  # sampled on the device

    def _token(self) -> int:
        self.next_token += 1
        return self.next_token - 1

    def process_batch_result(self, batch: Any) -> None:
        tokens = batch.output_ids.tolist()
        if batch.forward_mode.is_extend():
            self._process_prefill(batch, tokens)
        else:
            self._process_decode(batch, tokens)

    def _process_prefill(self, batch: Any, tokens: list[int]) -> None:
        for req, token in zip(batch.reqs, tokens):
            if not req.is_retracted:
                self._prefill_token(req, token)

    def _process_decode(self, batch: Any, tokens: list[int]) -> None:
        self.allocator.free_group_begin()
        for req, token in zip(batch.reqs, tokens):
            if not req.is_retracted:
                self._decode_token(req, token)
        self.allocator.free_group_end()

    def _prefill_token(self, req: Any, token: int) -> None:
        """`process_batch_result_prefill` for a request still in the batch: a chunk, or a token."""
        if req.is_chunked > 0:
            req.is_chunked -= 1
            return
        req.output_ids.append(EOS_ID if len(req.output_ids) + 1 == req.memcli_eos_len else token)
        req.check_finished()
        if req.finished():
            self._finish(req)
        else:
            self.tree_cache.cache_unfinished_req(req)

    def _decode_token(self, req: Any, token: int) -> None:
        """`process_batch_result_decode` for a request still in the batch."""
        req.output_ids.append(EOS_ID if len(req.output_ids) + 1 == req.memcli_eos_len else token)
        req.check_finished()
        if req.finished():
            self._finish(req)

    def _finish(self, req: Any) -> None:
        self.tree_cache.cache_finished_req(req)
        self.step_finished.append(req.rid)
        self.finished_rids.append(req.rid)

    def self_check_during_idle(self) -> None:
        """`check_memory()` (token pool and request rows), then reset the new-token ratio;
        with nothing waiting, the simulated clock jumps to the next arrival."""
        available, evictable = self.allocator.available_size(), self.tree_cache.evictable_size()
        protected = self.tree_cache.protected_size()
        if available + evictable != self.size - protected:
            raise IntegrityError(f"token_to_kv_pool_allocator memory leak detected! max_total_num_tokens={self.size},"
                                 f" available_size={available}, evictable_size={evictable}, protected_size={protected}")
        rows = self.req_to_token_pool.available_size()
        if rows != self.req_to_token_pool.size:
            raise IntegrityError(f"req_to_token_pool memory leak detected! available_size={rows},"
                                 f" total_size={self.req_to_token_pool.size}")
        self.new_token_ratio = self.init_new_token_ratio
        if self.pending and not self.waiting_queue:
            self.clock_ms = max(self.clock_ms, self.pending[0][0])

    # -- state for reports --------------------------------------------------------------------
    def sizes(self) -> tuple[int, int, int]:
        """(available, evictable, protected) tokens."""
        return (self.allocator.available_size(), self.tree_cache.evictable_size(), self.tree_cache.protected_size())

    def host_used(self) -> int:
        """Used slots of the host tier (0 without one)."""
        host = getattr(self.tree_cache, "token_to_kv_pool_host", None)
        return host.size - host.available_size() if host is not None else 0

    def running_rids(self) -> list[str]:
        return [r.rid for r in self.running_batch.reqs if not r.finished()]

    def waiting_rids(self) -> list[str]:
        return [r.rid for r in self.waiting_queue]
