"""Step-level differential run: memcli's scheduler against the engine's own code (SGLang 0.5.5's
or 0.5.23's loop, vLLM's scheduler), step by step.

    result = run_reference_diff(load_config(None, [], builtin="replay"), "trace.jsonl", limit=20)
    result.exit_code   # 0 equal, 1 divergent or failed

The loop compared is `semantics.event_loop` (overlap: SGLang's default `event_loop_overlap`;
`semantics.event_loop=normal` for `event_loop_normal`). The run stops at the first divergent
step, or when a side raises instead of taking its step (SGLang's own assertions and leak
check, memcli's integrity and progress guards): `memcli.reference.observe.run_side_by_side`.

Triton's mode: without CUDA, SGLang's kernels run in Triton's interpreter, which must be
chosen before a kernel is decorated. The reference loader chooses it before it imports
SGLang's modules; memcli's own kernels are decorated when `memcli.stack` is first imported,
so `run_reference_diff` chooses the mode before it imports the side-by-side run. (A process
that imported `memcli.kernels` earlier, without CUDA and without `TRITON_INTERPRET=1`, keeps
compiled kernels: `runtime.kernel_backend: triton` cannot run there, `auto` runs torch.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from memcli.capacity import check_fits
from memcli.config import Config
from memcli.errors import MemcliError
from memcli.reference.loader import choose_triton_mode
from memcli.reference.loop import ARRIVALS
from memcli.tools.reference_diff.results import ReferenceDiffResult
from memcli.tools.reference_diff.steps import BothLogs
from memcli.workload.readers import read_trace
from memcli.workload.spec import output_token_base


def run_reference_diff(config: Config, trace_path: str, limit: Optional[int] = None, arrivals: str = "burst",
                       max_steps: Optional[int] = None, steps_out: Optional[Path] = None,
                       reference_steps_out: Optional[Path] = None) -> ReferenceDiffResult:
    """Read the first `limit` requests of the trace (None: all), check that each fits the
    config (`memcli.capacity.check_fits`), and step both sides together, at most `max_steps`
    steps (None: until both are done). Raises `MemcliError` for bad input before either side
    runs. Both sides' step logs are kept, compared (`result.steps`) and written to `steps_out`
    (memcli) and `reference_steps_out` (the engine's own code) when given."""
    if arrivals not in ARRIVALS:
        raise MemcliError(f"--arrivals {arrivals}: unknown arrivals mode", f"use one of: {', '.join(ARRIVALS)}")
    trace = read_trace(trace_path, limit=limit)
    if arrivals == "timestamp" and not trace.has_timestamps:
        raise MemcliError(f"{trace.path}: --arrivals timestamp needs arrival times, and this trace has none",
                          "use --arrivals burst")
    check_fits(config, trace.requests, trace.path)
    choose_triton_mode()
    from memcli import engines  # after the mode: the engines import memcli's kernels

    engine = engines.get(config)
    if engine.reference is None:
        raise MemcliError(f"engine {engine.name} has no reference harness to diff against",
                          f"engines with one: {', '.join(n for n in engines.names() if engines.get(n).reference)}")
    if not engine.reference_steps:
        if steps_out is not None or reference_steps_out is not None:
            raise MemcliError(f"--steps-out / --reference-steps-out: engine {engine.name}'s reference harness"
                              " compares scheduled tokens, preemptions, finishes and block ids, not step logs",
                              f"drop them, or write memcli's side with: memcli replay TRACE --engine {engine.name}"
                              " --arrivals burst --steps-out FILE.jsonl")
        diff = engine.reference(config, trace.requests, arrivals, output_token_base(trace), max_steps)
        return ReferenceDiffResult(trace_path, limit, arrivals, config, diff, None)
    logs = BothLogs(config.pool_size, config.cache.kind == "hiradix")
    diff = engine.reference(config, trace.requests, arrivals, output_token_base(trace), max_steps, on_step=logs.on_step)
    logs.save(steps_out, reference_steps_out)
    return ReferenceDiffResult(trace_path, limit, arrivals, config, diff, logs.compare())
