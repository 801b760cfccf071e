"""Step-level differential: SGLang 0.5.23's loop over its own code vs memcli's scheduler under
the `sglang-0.5.23` engine, step by step (`reference diff --engine sglang-0.5.23`).

The reference runs whole in the 0.5.23 worker (`memcli.reference.v0523.loop`) and gives back
its step observations (and the step it raised at, if it did); memcli's scheduler runs here
(`memcli.reference.observe.MemcliSide`); the first step whose compared fields differ is the
divergence, and a side that raised is the run's failure, as for 0.5.5.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

from memcli.config import Config
from memcli.errors import MemcliError
from memcli.reference.failure import RAISED, debugging, raised_at, what_raised
from memcli.reference.observe import COMPARED, MemcliSide, StepDiff, StepObservation
from memcli.workload.spec import RequestSpec

CORE = "rust"  # SGLang's default tree core
REFERENCE_SIDE, MEMCLI_SIDE = "SGLang's loop", "memcli's scheduler"  # as a failure names them


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


class ReferenceRun(NamedTuple):
    steps: list[ReferenceStep]  # every step the reference took
    failure: Optional[str]  # the step it raised at instead (`memcli.reference.failure`), or None


def reference_run(worker: Any, config: Config, requests: Sequence[RequestSpec], arrivals: str,
                  output_token_base: int, max_steps: Optional[int] = None, core: str = CORE) -> ReferenceRun:
    """The reference's steps from the worker, and the step it raised at instead of taking it
    (SGLang's own checks; None when it ran to the end or to `max_steps`). Under
    `MEMCLI_DEBUG=1` the worker raises it instead (a `WorkerError` with its traceback's end)."""
    raw = worker.call("replay", config=config.to_dict(), requests=[_wire(r) for r in requests], arrivals=arrivals,
                      output_token_base=output_token_base, core=core, max_steps=max_steps, debug=debugging())
    failure = None
    if raw and "raised" in raw[-1]:
        last = raw.pop()
        failure = raised_at(REFERENCE_SIDE, last["step"], last["raised"])
    return ReferenceRun([_observation(step) for step in raw], failure)


def reference_steps(worker: Any, config: Config, requests: Sequence[RequestSpec], arrivals: str,
                    output_token_base: int, max_steps: Optional[int] = None, core: str = CORE) -> list[ReferenceStep]:
    """`reference_run`'s steps; a reference that raised is a `MemcliError` saying where."""
    run = reference_run(worker, config, requests, arrivals, output_token_base, max_steps, core)
    if run.failure is not None:
        raise MemcliError(run.failure)
    return run.steps


def watch_rows(mem: MemcliSide) -> list:
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
                  output_token_base: int, ref_s: float = 0.0, reference_failure: Optional[str] = None,
                  on_step: Optional[Callable[[StepObservation, StepObservation], None]] = None,
                  plain_loop: bool = False) -> StepDiff:
    """Step memcli beside the reference's steps (its steady decode runs taken at once unless
    `plain_loop`, each of their steps compared); the first step whose compared fields (or,
    as a failure, whose request rows) differ ends it, as does a memcli step that raises
    (`memcli.reference.failure`; re-raised under `MEMCLI_DEBUG=1`), or, after its last step,
    `reference_failure` (the step the reference raised at). `on_step(sglang, memcli)` sees
    both observations of every step compared, the divergent one included."""
    mem = MemcliSide(config, requests, arrivals, output_token_base, plain_loop)
    rows = watch_rows(mem)
    start = time.perf_counter()
    loop = config.behaviour.event_loop
    index, seen, run_rows = 0, [], None
    for index, (ref_obs, ref_rows) in enumerate(reference):
        if not seen:  # memcli's next step, or its next run of decode steps (compared one by one)
            if mem.is_done():
                return StepDiff(index + 1, None, ref_s, time.perf_counter() - start, loop,
                                failure=f"memcli's scheduler finished before SGLang's step {ref_obs.step}")
            rows[0] = ()
            try:
                seen = mem.steps(len(reference) - index)
                run_rows = mem.run_rows  # a run: each step's rows (its batch: the running requests then)
            except RAISED as exc:
                if debugging():
                    raise
                return StepDiff(index, None, ref_s, time.perf_counter() - start, loop,
                                failure=raised_at(MEMCLI_SIDE, index, what_raised(exc)))
        if run_rows:
            rows[0] = run_rows.pop(0)
        mem_obs = seen.pop(0)
        if on_step is not None:
            on_step(ref_obs, mem_obs)
        if ref_obs.differing(mem_obs):
            return StepDiff(index + 1, (ref_obs, mem_obs), ref_s, time.perf_counter() - start, loop)
        if ref_obs.kind != "idle" and rows[0] != ref_rows:
            return StepDiff(index + 1, None, ref_s, time.perf_counter() - start, loop,
                            failure=f"step {ref_obs.step}: request rows {list(rows[0])}, SGLang's {list(ref_rows)}")
    if reference_failure is not None:
        return StepDiff(len(reference), None, ref_s, time.perf_counter() - start, loop, failure=reference_failure)
    if not mem.is_done():
        mem_obs = mem.step()
        return StepDiff(len(reference) + 1, (mem_obs, mem_obs), ref_s, time.perf_counter() - start,
                        config.behaviour.event_loop, failure="memcli's scheduler has steps left after SGLang finished")
    return StepDiff(len(reference), None, ref_s, time.perf_counter() - start, config.behaviour.event_loop)


def run_side_by_side_0523(config: Config, requests: Sequence[RequestSpec], arrivals: str, output_token_base: int,
                          max_steps: Optional[int] = None, worker: Any = None,
                          on_step: Optional[Callable[[StepObservation, StepObservation], None]] = None,
                          plain_loop: bool = False) -> StepDiff:
    """The reference's run in the 0.5.23 worker (`worker`, or one of its own), then memcli's
    beside its steps (`compare_steps`, `on_step` as there). Raises `MemcliError` for settings
    the reference cannot share, or where it cannot run, before either side runs."""
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
        reference = reference_run(worker, config, requests, arrivals, output_token_base, max_steps)
        ref_s = time.perf_counter() - start
    finally:
        if own:
            worker.close()
    return compare_steps(reference.steps, config, requests, arrivals, output_token_base, ref_s, reference.failure,
                         on_step, plain_loop)


__all__ = ["COMPARED", "ReferenceRun", "ReferenceStep", "compare_steps", "reference_run", "reference_steps",
           "run_side_by_side_0523", "watch_rows"]
