"""A model-free reference scheduler: SGLang 0.5.23's `event_loop_normal` over its real objects.

`managers/scheduler.py` does not import on CPU (it needs the model-runner chain), so the loop
itself (`get_next_batch_to_run`, `_get_new_batch_prefill_raw`, `update_running_batch`, the
memory side of `process_batch_result_prefill/_decode`, `on_idle`) is written here, following
those functions of 0.5.23; everything it drives is 0.5.23's own: `Req` (`init_next_round_input`,
`update_finish_state`), `ScheduleBatch` (`init_new`, `prepare_for_extend` -> `allocation.py`,
`check_decode_mem` -> `check_decode_capacity`, `retract_decode`, `prepare_for_decode`,
`filter_batch`, `merge_batch`), `SchedulePolicy.calc_priority` (with the waiting-prefix refresh),
`PrefillAdder` over `PrefillBudget`, `common.py`'s `checkpoint_kv_cache` / `release_kv_cache`,
`UnifiedRadixCache` on the chosen tree core, the allocator and `ReqToTokenPool`.

`OverlapReferenceLoop0523` is `event_loop_overlap` (SGLang's default): batch N+1 is launched
before batch N's result is processed; decode leaves out the requests its queued result
finishes by length (`_reqs_finishing_inflight`), and skips the step instead of retracting
when memory is short while such requests exist.

Left out, as in the 0.5.5 loop: mixed chunks, priorities, LoRA, grammars, PD, DP attention,
speculative decoding, stop strings (a request finishes at its `max_new_tokens`, or on `EOS_ID` where the trace gives a larger `max_new_tokens`), and the host tier. Settings come from a memcli `Config` as for 0.5.5
(`memcli.reference.loop`); `run_reference_replay` returns one observation per step, in the
terms of `memcli.reference.observe.StepObservation` (JSON).
"""

from __future__ import annotations

import importlib
from array import array
from collections import deque
from types import SimpleNamespace
from typing import Any, Optional

import torch

from memcli.config import Config, config_from_dict
from memcli.errors import MemcliError
from memcli.reference.failure import RAISED, what_raised
from memcli.reference.v0523.stack import HostTier, build_stack_0523, publish_server_args

VOCAB_SIZE = 1 << 62  # sampled ids are fresh large integers; none is a stop token
LOAD_BACK_THRESHOLD = 10  # UnifiedRadixCache.init_hicache sets it (not an argument)
EOS_ID = VOCAB_SIZE - 1  # what a request the trace ends on EOS samples last (its only stop token)


def host_tier(config: Config) -> Optional[HostTier]:
    """`--enable-hierarchical-cache` with `--hicache-ratio` and `--hicache-write-policy` for
    `cache.kind hiradix`; None otherwise."""
    cache = config.cache
    if cache.kind != "hiradix":
        return None
    if cache.host_size_gib is not None:
        raise MemcliError("cache.host_size_gib sizes the host pool by the model's bytes per token, which SGLang's"
                          " side of the diff (a one-layer pool) does not share",
                          "size the host tier with cache.host_ratio (--set cache.host_size_gib=null)")
    if cache.load_back_threshold != LOAD_BACK_THRESHOLD:
        raise MemcliError(f"cache.load_back_threshold is {cache.load_back_threshold}; SGLang 0.5.23's"
                          f" init_hicache fixes it at {LOAD_BACK_THRESHOLD}",
                          f"use --set cache.load_back_threshold={LOAD_BACK_THRESHOLD}")
    return HostTier(cache.write_policy, cache.host_ratio)


class ReferenceLoop0523:
    def __init__(self, ref: Any, config: Config, requests: list, arrivals: str, output_token_base: int,
                 core: str = "rust"):
        self.ref, self.config = ref, config
        ps, mem, sched = config.page_size, config.memory, config.scheduler
        publish_server_args(ref, ps, chunked_prefill_size=sched.chunked_prefill_size,
                            max_prefill_tokens=sched.max_prefill_tokens, schedule_policy=sched.policy,
                            radix_eviction_policy=config.cache.eviction_policy,
                            max_running_requests=mem.max_running_requests)
        ref.schedule_policy.CLIP_MAX_NEW_TOKENS = sched.max_new_tokens_clip
        stack = build_stack_0523(ref, config.pool_size, ps, core, config.cache.eviction_policy,
                                 rows=mem.max_running_requests, context_len=mem.max_context_len + 4,
                                 disable=config.cache.kind == "none", host=host_tier(config))
        self.hierarchical = stack.tree.cache_controller is not None
        self.tree, self.allocator, self.req_to_token_pool = stack.tree, stack.allocator, stack.req_to_token_pool
        self._count_evictions()
        self.policy = ref.schedule_policy.SchedulePolicy(sched.policy, self.tree, False, False, False)
        self.model_config = SimpleNamespace(vocab_size=VOCAB_SIZE, is_encoder_decoder=False, hidden_size=64,
                                            is_matryoshka=False, attention_chunk_size=None)
        self.spec = importlib.import_module("sglang.srt.speculative.spec_info").SpeculativeAlgorithm.NONE
        self.enable_overlap = False
        self.max_running = mem.max_running_requests
        self.max_req_len = min(mem.max_context_len - 1, config.pool_size - 1)
        self.init_ratio = min(sched.init_new_token_ratio, 1.0)
        self.min_ratio = min(self.init_ratio * sched.min_new_token_ratio_factor, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / sched.new_token_ratio_decay_steps
        self.new_token_ratio = self.init_ratio
        self.pending = deque((0.0 if arrivals == "burst" else float(r[4] or 0.0), r) for r in requests)
        self.num_requests = len(requests)
        self.waiting: list = []
        self.running = self._empty_batch()
        self.last_batch = None
        self.chunked_req = None
        self.clock_ms, self.step_count, self.next_token = 0.0, 0, output_token_base
        self.finished_rids: list[str] = []
        self.step_kind, self.step_batch, self.step_evicted = "idle", None, 0
        self.step_retracted: list[str] = []
        self.step_finished: list[str] = []

    def _count_evictions(self) -> None:
        tree = self.tree
        for name in ("evict", "evict_for_alloc"):
            real = getattr(tree, name)

            def wrapped(*args, _real=real, **kwargs):
                before = tree.evictable_size()
                result = _real(*args, **kwargs)
                self.step_evicted += before - tree.evictable_size()
                return result

            setattr(tree, name, wrapped)

    def _empty_batch(self) -> Any:
        return self.ref.ScheduleBatch(reqs=[], batch_is_full=False)

    # -- the loop ---------------------------------------------------------------------------
    def is_done(self) -> bool:
        return len(self.finished_rids) == self.num_requests

    def step(self) -> None:
        batch = self._next_step_batch()
        if batch is not None:
            tokens = self.run_batch(batch)
            self.process_batch_result(batch, tokens)
        else:
            self.on_idle()
        self._end_step(batch)

    def _next_step_batch(self) -> Any:
        """The start of a step, in both loops: this step's records reset, arrivals received,
        and the batch to run (None: idle)."""
        self.step_evicted, self.step_retracted, self.step_finished = 0, [], []
        self._recv_requests()
        batch = self.get_next_batch_to_run()
        self.step_kind = "idle" if batch is None else "prefill" if batch.forward_mode.is_extend() else "decode"
        return batch

    def _end_step(self, batch: Any) -> None:
        self.step_batch = self.last_batch = batch
        self.step_count += 1

    def _recv_requests(self) -> None:
        ref = self.ref
        while self.pending and self.pending[0][0] <= self.clock_ms:
            _, (rid, input_ids, _output, extra_key, _arrival, ignore_eos, max_new, eos_len) = self.pending.popleft()
            params = importlib.import_module("sglang.srt.sampling.sampling_params").SamplingParams(
                max_new_tokens=max_new, ignore_eos=ignore_eos, stop_token_ids=None if eos_len is None else [EOS_ID])
            params.normalize(None)
            req = ref.Req(rid, "", array("q", input_ids), params, vocab_size=VOCAB_SIZE, extra_key=extra_key)
            req.memcli_eos_len = eos_len  # its output length when it samples EOS_ID (None: never)
            self._init_max_new_tokens(req)
            self.waiting.append(req)

    def _init_max_new_tokens(self, req: Any) -> None:
        """`Scheduler.init_req_max_new_tokens`: the max_req_len clip, then the memory clip."""
        input_len = len(req.origin_input_ids)
        max_new = max(0, min(req.sampling_params.max_new_tokens, self.max_req_len - input_len - 1))
        max_new = self.allocator.max_new_tokens_for_memory(
            input_len, max_new, token_capacity=self.config.pool_size, sliding_window_size=None,
            chunk_size=self.config.scheduler.chunked_prefill_size)
        req.sampling_params.max_new_tokens = max(0, max_new if max_new is not None else 0)

    def get_next_batch_to_run(self) -> Optional[Any]:
        if self.hierarchical:  # Scheduler._process_hicache_events, first thing every step
            self.tree.check_hicache_events()
        exclude = set()
        common = self.ref.common
        if self.chunked_req is not None:
            exclude.add(self.chunked_req)
            if self.chunked_req.extend_end > self.chunked_req.prefix_len:
                common.checkpoint_kv_cache(self.chunked_req, self.tree)
        last, running = self.last_batch, self.running
        if last is not None and last.forward_mode.is_extend():
            if last.chunked_req is not None:
                exclude.add(last.chunked_req)
            last_bs = last.batch_size()
            last.filter_batch(reqs_to_exclude=list(exclude))
            if last.batch_size() < last_bs:
                running.batch_is_full = False
            if not last.is_empty() and last is not running:
                if running.is_empty():
                    running = last
                else:
                    running.merge_batch(last)
        running_bs = running.batch_size()
        running.filter_batch()
        if running.batch_size() < running_bs:
            running.batch_is_full = False
        self.running = running
        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if not self.running.is_empty():
            decode = self.update_running_batch(self.running)
            return decode if decode is not None and not decode.is_empty() else None
        return None

    def _allocatable(self, running_bs: int, held: int = 0) -> int:
        return min(self.max_running - running_bs, max(self.req_to_token_pool.available_size() + held, 0))

    def get_new_batch_prefill(self) -> Optional[Any]:
        ref, running = self.ref, self.running
        AddReqResult = ref.schedule_policy.AddReqResult
        if running.is_empty():
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting) and self.chunked_req is None:
            return None
        running_bs = len(running.reqs)
        if self._allocatable(running_bs) <= 0 and self.chunked_req is None:
            running.batch_is_full = True
            return None
        self.policy.calc_priority(self.waiting, running)
        sched = self.config.scheduler
        adder = ref.PrefillAdder(self.config.page_size, self.tree, self.allocator, running, self.new_token_ratio,
                                 sched.max_prefill_tokens, sched.chunked_prefill_size, 0, 0,
                                 max_running_requests=self.max_running)
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= self._allocatable(len(running.reqs), held):
                running.batch_is_full = True
            if running.batch_is_full:
                break
            req.init_next_round_input(self.tree)
            res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    running.batch_is_full = len(adder.can_run_list) > 0 or not running.is_empty()
                break
        return self._prefill_batch(adder)

    def _prefill_batch(self, adder: Any) -> Optional[Any]:
        can_run = adder.can_run_list
        if not can_run:
            return None
        chosen = set(can_run)
        self.waiting = [r for r in self.waiting if r not in chosen]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = self.ref.ScheduleBatch.init_new(can_run, self.req_to_token_pool, self.allocator, self.tree,
                                                self.model_config, self.enable_overlap, self.spec,
                                                chunked_req=self.chunked_req)
        if self.hierarchical:
            batch.hicache_consumer_index = self.tree.ready_to_load_host_cache()
        batch.prepare_for_extend()
        batch.decoding_reqs = None
        return batch

    def _reqs_finishing_inflight(self, batch: Any) -> list:
        return []

    def update_running_batch(self, batch: Any) -> Optional[Any]:
        initial_bs = batch.batch_size()
        finishing = self._reqs_finishing_inflight(batch)
        batch.filter_batch(reqs_to_exclude=finishing)
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        short = not batch.check_decode_mem()
        if short and finishing:
            batch.batch_is_full = False
            return None
        if short:
            retracted, self.new_token_ratio, aborted = batch.retract_decode()
            for req in retracted:
                self.step_retracted.append(req.rid)
                self.waiting.append(req)
            for req in aborted:
                self.step_finished.append(req.rid)
                self.finished_rids.append(req.rid)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        if batch.is_empty():
            return batch
        batch.prepare_for_decode()
        return batch

    def run_batch(self, batch: Any) -> list[int]:
        """The simulated forward (memcli's cost model); one fresh token per request."""
        sim = self.config.sim
        self.step_rows = [int(r.kv.req_pool_idx) for r in batch.reqs]
        if batch.forward_mode.is_extend():
            kv_read = int(sum(batch.prefix_lens))
            self.clock_ms += (sim.step_base_ms + sim.prefill_token_us * batch.extend_num_tokens / 1e3
                              + sim.kv_read_ns * kv_read / 1e6)
            return [0 if req is batch.chunked_req else self._token() for req in batch.reqs]
        kv_read = int(batch.seq_lens_cpu.sum())
        self.clock_ms += (sim.step_base_ms + sim.decode_req_us * batch.batch_size() / 1e3
                          + sim.kv_read_ns * kv_read / 1e6)
        return [self._token() for _ in batch.reqs]

    def _token(self) -> int:
        self.next_token += 1
        return self.next_token - 1

    def process_batch_result(self, batch: Any, tokens: list[int]) -> None:
        common, prefill = self.ref.common, batch.forward_mode.is_extend()
        self.allocator.free_group_begin()
        for req, token in zip(batch.reqs, tokens):
            if req.is_retracted or (req.finished() and req.inflight_middle_chunks <= 0):
                continue
            if prefill and req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                continue
            if len(req.output_ids) + 1 == req.memcli_eos_len:
                token = EOS_ID
            req.output_ids.append(token)
            req.update_finish_state()
            if req.finished():
                common.release_kv_cache(req, self.tree, checkpoint=True)
                self.step_finished.append(req.rid)
                self.finished_rids.append(req.rid)
            elif prefill:
                common.checkpoint_kv_cache(req, self.tree)
        self.allocator.free_group_end()
        if self.hierarchical:  # run_batch's end: this batch's queued host backups are submitted
            self.tree.flush_pending_backups()

    def on_idle(self) -> None:
        available, evictable = self.allocator.available_size(), self.tree.evictable_size()
        protected = self.tree.protected_size()
        if available + evictable + protected != self.config.pool_size:
            raise AssertionError(f"KV leak: available {available} + evictable {evictable} + protected"
                                 f" {protected} != {self.config.pool_size}")
        self.new_token_ratio = self.init_ratio
        if self.pending and not self.waiting:
            self.clock_ms = max(self.clock_ms, self.pending[0][0])

    # -- observations -------------------------------------------------------------------------
    def _host_used(self) -> int:
        if not self.hierarchical:
            return 0
        host = self.tree.cache_controller.mem_pool_host.anchor_entry.host_pool  # the KV host pool
        return host.size - host.available_size()

    def observe(self) -> dict:
        batch = self.step_batch if self.step_kind != "idle" else None
        rids, extend, prefix, loc = (), (), (), ()
        if batch is not None:
            rids = tuple(r.rid for r in batch.reqs)
            loc = tuple(int(v) for v in batch.out_cache_loc.tolist())
            if self.step_kind == "prefill":
                extend = tuple(int(v) for v in batch.extend_lens)
                prefix = tuple(int(v) for v in batch.prefix_lens)
        rows = self.step_rows if batch is not None else []
        return {"step": self.step_count - 1, "kind": self.step_kind, "rids": list(rids), "extend_lens": list(extend),
                "rows": rows,
                "prefix_lens": list(prefix), "out_cache_loc": list(loc), "evicted": self.step_evicted,
                "retracted": self.step_retracted, "finished": self.step_finished,
                "available": self.allocator.available_size(), "evictable": self.tree.evictable_size(),
                "protected": self.tree.protected_size(), "host_used": self._host_used(), "clock_ms": self.clock_ms,
                "waiting": [r.rid for r in self.waiting], "running": [r.rid for r in self.running.reqs],
                "chunked": self.chunked_req.rid if self.chunked_req is not None else None,
                "new_token_ratio": self.new_token_ratio}


class OverlapReferenceLoop0523(ReferenceLoop0523):
    """`ReferenceLoop0523` stepping `event_loop_overlap`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.enable_overlap = True
        self.result_queue: deque = deque()

    def is_done(self) -> bool:
        return super().is_done() and self.last_batch is None and not self.result_queue

    def step(self) -> None:
        batch = self._next_step_batch()
        if batch is not None:
            tokens = self.run_batch(batch)
            self.result_queue.append((batch.copy(), tokens))
        if self.last_batch is not None:
            queued, tokens = self.result_queue.popleft()
            self.process_batch_result(queued, tokens)
        elif batch is None:
            self.on_idle()
        self._end_step(batch)

    def _reqs_finishing_inflight(self, batch: Any) -> list:
        """Requests of the queued (launched, unprocessed) batch whose result finishes them by length."""
        if not self.result_queue:
            return []
        queued = set(self.result_queue[0][0].reqs)
        return [r for r in batch.reqs if r in queued and r.next_output_finishes_by_length()]


def run_reference_replay(ref: Any, config: dict, requests: list, arrivals: str = "burst",
                         output_token_base: int = 1 << 40, core: str = "rust",
                         max_steps: Optional[int] = None, debug: bool = False) -> list[dict]:
    """Every step's observation until all requests finished (or `max_steps`), in the loop
    `semantics.event_loop` names. A step that raises (SGLang's own checks, the leak check;
    `memcli.reference.failure.RAISED`) ends the list with `{"raised": WHAT, "step": N}`
    instead of its observation; with `debug` (the client's `MEMCLI_DEBUG=1`) it is raised
    (the task's error, with its traceback)."""
    config = config_from_dict(config)
    cls = OverlapReferenceLoop0523 if config.behaviour.event_loop == "overlap" else ReferenceLoop0523
    loop = cls(ref, config, requests, arrivals, output_token_base, core)
    out = []
    while not loop.is_done() and (max_steps is None or loop.step_count < max_steps):
        try:
            loop.step()
        except RAISED as exc:
            if debug:
                raise
            out.append({"raised": what_raised(exc), "step": loop.step_count})
            break
        out.append(loop.observe())
    return out
