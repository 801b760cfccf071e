"""Step-level differential: SGLang 0.5.23's loop over its own code vs memcli's scheduler under
the `sglang-0.5.23` engine, step by step (`reference diff --engine sglang-0.5.23`).

The reference runs whole in the 0.5.23 worker (`memcli.reference.v0523.loop`) and gives back
its step observations; memcli's scheduler runs here (`memcli.reference.observe.MemcliSide`);
the first step whose compared fields differ is the divergence.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Optional, Sequence

from memcli.config import Config
from memcli.errors import MemcliError
from memcli.reference.observe import COMPARED, MemcliSide, StepDiff, StepObservation
from memcli.workload.spec import RequestSpec

CORE = "rust"  # SGLang's default tree core


def _wire(spec: RequestSpec) -> list:
    return [spec.rid, [int(t) for t in spec.input_ids()], spec.output_len, spec.extra_key, spec.arrival_ms,
            spec.ignore_eos, spec.sampling_limit, spec.eos_len]


class ReferenceStep(NamedTuple):
    obs: StepObservation
    rows: tuple[int, ...]  # the request rows of the step's batch (ids only; not in StepObservation)


def _observation(raw: dict) -> ReferenceStep:
    rows = tuple(raw.pop("rows", ()))
    fields = {name: tuple(raw[name]) if isinstance(raw[name], list) else raw[name] for name in raw}
    return ReferenceStep(StepObservation(**fields), rows)


def reference_steps(worker: Any, config: Config, requests: Sequence[RequestSpec], arrivals: str,
                    output_token_base: int, max_steps: Optional[int] = None, core: str = CORE) -> list[ReferenceStep]:
    raw = worker.call("replay", config=config.to_dict(), requests=[_wire(r) for r in requests], arrivals=arrivals,
                      output_token_base=output_token_base, core=core, max_steps=max_steps)
    return [_observation(step) for step in raw]


def _watch_rows(mem: MemcliSide) -> list:
    """The rows of each batch memcli runs (read where its cost model sees the batch)."""
    seen: list = [()]
    for name in ("prefill_cost_ms", "decode_cost_ms"):
        real = getattr(mem.scheduler, name)

        def cost(batch, _real=real):
            seen[0] = tuple(int(r.req_pool_idx) for r in batch.reqs)
            return _real(batch)

        setattr(mem.scheduler, name, cost)
    return seen


def compare_steps(reference: list[ReferenceStep], config: Config, requests: Sequence[RequestSpec], arrivals: str,
                  output_token_base: int, ref_s: float = 0.0) -> StepDiff:
    """Step memcli beside the reference's steps; the first step whose compared fields (or,
    as a failure, whose request rows) differ ends it."""
    mem = MemcliSide(config, requests, arrivals, output_token_base)
    rows = _watch_rows(mem)
    start = time.perf_counter()
    loop = config.behaviour.event_loop
    for index, (ref_obs, ref_rows) in enumerate(reference):
        if mem.is_done():
            return StepDiff(index + 1, None, ref_s, time.perf_counter() - start, loop,
                            failure=f"memcli's scheduler finished before SGLang's step {ref_obs.step}")
        rows[0] = ()
        mem_obs = mem.step()
        if ref_obs.differing(mem_obs):
            return StepDiff(index + 1, (ref_obs, mem_obs), ref_s, time.perf_counter() - start, loop)
        if ref_obs.kind != "idle" and rows[0] != ref_rows:
            return StepDiff(index + 1, None, ref_s, time.perf_counter() - start, loop,
                            failure=f"step {ref_obs.step}: request rows {list(rows[0])}, SGLang's {list(ref_rows)}")
    if not mem.is_done():
        mem_obs = mem.step()
        return StepDiff(len(reference) + 1, (mem_obs, mem_obs), ref_s, time.perf_counter() - start,
                        config.behaviour.event_loop, failure="memcli's scheduler has steps left after SGLang finished")
    return StepDiff(len(reference), None, ref_s, time.perf_counter() - start, config.behaviour.event_loop)


def run_side_by_side_0523(config: Config, requests: Sequence[RequestSpec], arrivals: str, output_token_base: int,
                          max_steps: Optional[int] = None, worker: Any = None) -> StepDiff:
    from memcli.reference.v0523.client import Worker0523, unavailable_reason_0523
    from memcli.reference.v0523.loop import host_tier

    if config.cache.kind == "chunk" or config.cache.eviction_policy == "belady":
        raise MemcliError(f"cache.kind {config.cache.kind} / eviction_policy {config.cache.eviction_policy}: the"
                          " SGLang 0.5.23 reference runs the unified radix tree (lru, lfu; host tier optional) only",
                          "use --set cache.kind=radix or hiradix and cache.eviction_policy=lru or lfu")
    host_tier(config)  # refuses host-tier settings SGLang's side cannot share, before the worker starts
    reason = unavailable_reason_0523()
    if reason is not None:
        raise MemcliError(f"the SGLang 0.5.23 reference cannot run here: {reason}")
    own = worker is None
    worker = worker or Worker0523()
    try:
        start = time.perf_counter()
        reference = reference_steps(worker, config, requests, arrivals, output_token_base, max_steps)
        ref_s = time.perf_counter() - start
    finally:
        if own:
            worker.close()
    return compare_steps(reference, config, requests, arrivals, output_token_base, ref_s)


__all__ = ["COMPARED", "ReferenceStep", "compare_steps", "reference_steps", "run_side_by_side_0523"]
