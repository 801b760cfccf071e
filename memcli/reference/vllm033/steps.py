"""Step-level differential: vLLM 0.33's real v1 `Scheduler` (under a fake model) and memcli's
`VllmScheduler`, fed the same requests, compared step by step.

The fake model samples one token (unique per request, never in a prompt) for every request
whose scheduled chunk reaches its last token, and nothing for a non-final prefill chunk.
Compared per step: the tokens scheduled per request, the preempted requests, the finished
requests, and each scheduled request's block ids. A request reaches vLLM with its arrival on
memcli's clock as `arrival_time` and the trace's `priority` (both read by the priority policy).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple, Optional

from memcli.config import SimConfig
from memcli.mem_cache.block_manager import BlockManager
from memcli.reference.vllm033.loader import VllmReference, load_vllm
from memcli.reference.vllm033.ops import real_request
from memcli.steps import VLLM_WINDOW_REQUESTS, SchedulerHooks, VllmReported
from memcli.vllm_sched.scheduler import VllmScheduler, VllmSchedulerConfig


class Strict(SimpleNamespace):
    """A config namespace that names the attribute vLLM asked for and memcli did not set."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"memcli's stand-in vLLM config has no {name!r}; vLLM's scheduler reads it")


def vllm_config(settings: VllmSchedulerConfig, block_size: int, num_blocks: int, enable_caching: bool = True) -> Strict:
    """The attributes vLLM's `Scheduler.__init__` and `schedule` read, for one plain
    decoder-only model on one rank with every optional feature off."""
    sched = Strict(
        max_num_seqs=settings.max_num_seqs, max_num_active_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_scheduled_tokens=settings.max_num_batched_tokens,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=False, enable_chunked_prefill=settings.enable_chunked_prefill,
        policy=settings.policy, watermark=0.0, scheduler_reserve_full_isl=settings.reserve_full_isl,
        prefill_schedule_interval=1, async_scheduling=settings.async_scheduling, disable_chunked_mm_input=False)
    cache = Strict(block_size=block_size, num_gpu_blocks=num_blocks, enable_prefix_caching=enable_caching,
                   enable_mamba_shared_prefix_checkpoint=False, mamba_cache_mode="none", prefix_caching_hash_algo="sha256")
    model = Strict(max_model_len=settings.max_model_len, uses_mrope=False, is_encoder_decoder=False, runner_type="generate",
                   is_diffusion=False, supports_multimodal_inputs=False, return_sampling_mask=False)
    parallel = Strict(data_parallel_index=0, data_parallel_size=1, pipeline_parallel_size=1,
                      decode_context_parallel_size=1, prefill_context_parallel_size=1, data_parallel_rank=0,
                      tensor_parallel_size=1)
    observability = Strict(kv_cache_metrics=False, kv_cache_metrics_sample=0.0, per_request_spec_decode_metrics=False,
                           enable_mfu_metrics=False, enable_logging_iteration_details=False)
    return Strict(scheduler_config=sched, cache_config=cache, model_config=model, parallel_config=parallel,
                  observability_config=observability, lora_config=None, kv_events_config=None, kv_transfer_config=None,
                  ec_transfer_config=None, speculative_config=None,
                  max_concurrent_batches=2 if settings.async_scheduling else 1,
                  num_lookahead_tokens=0, num_speculative_tokens=0, num_prefill_lookahead_tokens=0,
                  num_hash_lookahead_tokens=0, max_in_flight_tokens=None, is_mm_encoder_only=False,
                  use_v2_model_runner=False,
                  aux_output_config=Strict(enabled=False),
                  ec_manager_config=Strict(get_encoder_cache_manager_obj=lambda *a, **k: None))


class FakeStructuredOutputs:
    def accept_tokens(self, *args, **kwargs) -> bool:
        return True

    def should_advance(self, *args, **kwargs) -> bool:
        return False

    def grammar_init(self, *args, **kwargs) -> None:
        return None


def real_scheduler(ref: VllmReference, settings: VllmSchedulerConfig, block_size: int, num_blocks: int,
                   enable_caching: bool = True) -> Any:
    import torch
    kci = ref.kv_cache_interface
    spec = kci.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16)
    kv_config = kci.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=[kci.KVCacheGroupSpec(["layer.0"], spec)])
    cls = ref.async_scheduler.AsyncScheduler if settings.async_scheduling else ref.scheduler.Scheduler
    return cls(vllm_config=vllm_config(settings, block_size, num_blocks, enable_caching),
                                   kv_cache_config=kv_config, structured_output_manager=FakeStructuredOutputs(),
                                   block_size=block_size, log_stats=True)


@dataclass
class StepObservation:
    """One engine-core step as one side saw it: the step scheduled (tokens per request,
    preempted ids, each scheduled request's block ids) and the requests that finished."""

    step: int
    scheduled: dict = field(default_factory=dict)
    preempted: list = field(default_factory=list)
    blocks: dict = field(default_factory=dict)
    finished: list = field(default_factory=list)

    def differing(self, other: "StepObservation") -> list[str]:
        return [f for f in ("scheduled", "preempted", "blocks", "finished") if getattr(self, f) != getattr(other, f)]

    def lines(self) -> list[str]:
        sched = ", ".join(f"{rid}:{n}" for rid, n in self.scheduled.items())
        return [f"step {self.step}: scheduled {sched or '-'}", f"preempted {self.preempted or '-'}",
                f"finished {self.finished or '-'}",
                *(f"blocks {rid}: {ids[:8]}{'...' if len(ids) > 8 else ''} ({len(ids)})" for rid, ids in self.blocks.items())]


class VllmStepDiff(NamedTuple):
    """The side-by-side run: steps compared, the first divergence (vLLM's, memcli's), run
    times, the loop, and both sides' prefix-cache counters (queries, hits, preempted
    queries, preempted hits), memcli's preemptions and finishes."""

    steps: int
    divergence: Optional[tuple[StepObservation, StepObservation]]
    reference_s: float
    memcli_s: float
    event_loop: str
    notes: tuple = ()
    failure: Optional[str] = None
    real_stats: tuple = ()
    mem_stats: tuple = ()
    preemptions: int = 0
    finished: int = 0
    reference: str = "vllm"  # what reports call the reference side
    # The hit rate each side's logger would log last (requests, queries, hits): vLLM's own
    # `CachingMetrics` over its steps' stats, memcli's `VllmReported` over its own.
    real_window: tuple = ()
    mem_window: tuple = ()


@dataclass
class SideBySide:
    """vLLM's `Scheduler` (or `AsyncScheduler` with the engine core's batch queue) and
    memcli's `VllmScheduler` over one list of `RequestSpec`s. A request reaches vLLM when it
    has arrived on memcli's simulated clock (vLLM has no clock of its own)."""

    specs: list
    settings: VllmSchedulerConfig
    block_size: int
    num_blocks: int
    arrivals: str = "burst"
    sim: SimConfig = field(default_factory=SimConfig)
    token_base: int = 1 << 40
    ref: VllmReference = field(default_factory=lambda: load_vllm(scheduler=True))
    window_requests: int = VLLM_WINDOW_REQUESTS  # the loggers' max_recent_requests

    def __post_init__(self):
        self.real = real_scheduler(self.ref, self.settings, self.block_size, self.num_blocks)
        memory = BlockManager(self.num_blocks, self.block_size, self.settings.max_model_len,
                              max_running=self.settings.max_num_seqs)
        self.mem = VllmScheduler(memory, self.settings, self.sim, SchedulerHooks(output_token_base=self.token_base))
        self.mem.keep_plans = True
        self.next = 0
        self.pending: list = []  # added to memcli, not yet arrived for vLLM
        self.queue: deque = deque()  # vLLM's batch queue (async)
        self.real_stats = [0, 0, 0, 0]
        self.real_window = self.ref.stats.CachingMetrics(max_recent_requests=self.window_requests)

    def _add(self, spec, arrival_ms: float) -> None:
        tokens = [int(t) for t in spec.input_ids()]
        self.mem.add_request(self.mem.new_req(spec.rid, tokens, spec.output_len, None, arrival_ms, spec.priority))
        self.pending.append((arrival_ms, spec.rid, tokens, spec.output_len, spec.priority))

    def _feed(self) -> None:
        specs, mem = self.specs, self.mem
        if self.arrivals == "burst":
            while self.next < len(specs):
                self._add(specs[self.next], 0.0)
                self.next += 1
        else:
            while self.next < len(specs) and specs[self.next].arrival_ms <= mem.clock_ms:
                self._add(specs[self.next], specs[self.next].arrival_ms)
                self.next += 1
            if self.next < len(specs) and mem.is_done():
                self._add(specs[self.next], specs[self.next].arrival_ms)
                self.next += 1
        while self.pending and self.pending[0][0] <= mem.clock_ms:
            arrival_ms, rid, tokens, output_len, priority = self.pending.pop(0)
            req = real_request(self.ref, rid, tokens, self.block_size, max_tokens=output_len, arrival_time=arrival_ms,
                               priority=priority)
            self.real.add_request(req)

    def run(self, max_steps: Optional[int] = None) -> VllmStepDiff:
        import time
        steps, times = 0, [0.0, 0.0]
        while True:
            self._feed()
            if self.mem.is_done() and self.next >= len(self.specs):
                break
            if max_steps is not None and steps >= max_steps:
                break
            start = time.perf_counter()
            real_obs = self._real_step(steps)
            middle = time.perf_counter()
            self.mem.step()
            end = time.perf_counter()
            mem_obs = self._mem_obs(steps)
            real_obs.finished = self._finish_real()
            times[0] += middle - start + time.perf_counter() - end
            times[1] += end - middle
            steps += 1
            if real_obs != mem_obs:
                return self._result(steps, (real_obs, mem_obs), times)
        return self._result(steps, None, times)

    def _result(self, steps: int, divergence, times) -> VllmStepDiff:
        m = self.mem.memory.stats
        loop = "async" if self.settings.async_scheduling else "sync"
        w = self.real_window
        mine = VllmReported.of_steps(self.mem.stats.prefix_cache_steps, self.window_requests)
        return VllmStepDiff(steps, divergence, times[0], times[1], loop, (), None, tuple(self.real_stats),
                            (m.queries, m.hits, m.preempted_queries, m.preempted_hits),
                            self.mem.stats.retractions, self.mem.stats.finished,
                            real_window=(w.aggregated_requests, w.aggregated_query_total, w.aggregated_query_hit),
                            mem_window=(0, 0, 0) if mine is None else
                            (mine.window_requests, mine.window_queries, mine.window_hits))

    def _real_step(self, step: int) -> StepObservation:
        """One engine-core step of vLLM: `step()` (sync) or `step_with_batch_queue()` (async)."""
        real, obs = self.real, StepObservation(step)
        launched = None
        if real.has_requests():
            launched = real.schedule()
            obs.scheduled = dict(launched.num_scheduled_tokens)
            obs.preempted = sorted(launched.preempted_req_ids or ())
            obs.blocks = {rid: list(real.kv_cache_manager.get_block_ids(rid)[0])
                          for rid in launched.num_scheduled_tokens}
            samples = [rid for rid in launched.num_scheduled_tokens if not real.requests[rid].is_prefill_chunk]
            if not self.settings.async_scheduling:
                self._pending_process = [(launched, samples)]
                return obs
            self.queue.appendleft((launched, samples))
            if len(self.queue) < 2 and (launched.total_num_scheduled_tokens > 0 or real.has_requests()):
                self._pending_process = []
                return obs
        elif not self.queue:
            self._pending_process = []
            return obs
        self._pending_process = [self.queue.pop()]
        return obs

    def _mem_obs(self, step: int) -> StepObservation:
        mem = self.mem
        launched = mem.plans[-1] if mem.plans else None
        mem.plans.clear()
        obs = StepObservation(step)
        if launched is not None:
            obs.scheduled = dict(launched.num_scheduled)
            obs.preempted = sorted(launched.preempted)
            obs.blocks = {rid: launched.block_ids.get(rid, []) for rid in launched.num_scheduled}
        obs.finished = sorted(r.request_id for r in mem.finished)
        mem.finished.clear()
        self._tokens = {}
        for plan in mem.processed:
            self._tokens.update(plan.sampled)
        return obs

    def _finish_real(self) -> list[str]:
        """Process vLLM's step output with the tokens memcli sampled in this step; its finished ids."""
        finished = []
        for so, samples in self._pending_process:
            finished.extend(self._real_update(so, samples))
        return sorted(finished)

    def _real_update(self, so, samples: list[str]) -> list[str]:
        ids = list(so.num_scheduled_tokens)
        sampled = [[self._tokens.get(rid, -1)] if rid in samples else [] for rid in ids]
        mro = self.ref.outputs.ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                 sampled_token_ids=sampled)
        finished = []
        for eco in self.real.update_from_output(so, mro).values():
            finished.extend(o.request_id for o in eco.outputs if o.finish_reason is not None)
            stats = eco.scheduler_stats.prefix_cache_stats if eco.scheduler_stats else None
            if stats is not None:
                self.real_window.observe(stats)  # as vLLM's logger does with every step's stats
                for i, name in enumerate(("queries", "hits", "preempted_queries", "preempted_hits")):
                    self.real_stats[i] += getattr(stats, name)
        return finished


def run_vllm_side_by_side(settings: VllmSchedulerConfig, block_size: int, num_blocks: int, requests: list,
                          arrivals: str, sim: SimConfig, output_token_base: int,
                          max_steps: Optional[int] = None) -> VllmStepDiff:
    """`reference diff --engine vllm-0.33`: vLLM's scheduler and memcli's, `burst` or
    `timestamp` arrivals, to the end or `max_steps`."""
    if arrivals not in ("burst", "timestamp"):
        raise ValueError(f"vLLM's side-by-side run takes burst or timestamp arrivals, not {arrivals}")
    return SideBySide(list(requests), settings, block_size, num_blocks, arrivals, sim, output_token_base).run(max_steps)
