"""`check-page-size` as a function: static checks, cost of the page size, and a checked paged
workload, for one or several page sizes, with optional page-size injection.

Phases per page size: the workload in the config's scheduler loop (`semantics.event_loop`,
the main phase), the bench path, then the workload again in the other loop.

    result = run_check_page_size(config, page_sizes=[1, 16], injections={"tree_cache": 1})
    result.exit_code   # 0 consistent, 1 some check failed

Injection (`COMPONENT.page_size=N`) is a debugging switch: it gives one component another page
size than the config's through `build_stack(page_size_overrides=...)`, so the run shows which
invariant such a bug breaks first. Bad input raises `MemcliError` (exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

from memcli.tools.check_page_size import DEFAULT_STEPS, TRACE_DEFAULT_REQUESTS
from memcli.tools.check_page_size.blocks import BLOCK_HOLDERS, run_block_page_size
from memcli.tools.check_page_size.dynamic import FaultHook, PhaseResult, run_phase
from memcli.tools.check_page_size.results import CheckPageSizeResult, PageSizeRun
from memcli.tools.check_page_size.static import page_cost, static_checks
from memcli.tools.check_page_size.workload import (
    Workload, bench_workload, builtin_config, builtin_workload, indices_only, trace_workload,
)
from memcli.capacity import check_fits
from memcli.config import Config, replace
from memcli.errors import MemcliError
from memcli import engines
from memcli.mem_cache.manager import COMPONENTS
from memcli.mem_cache.pages import align_down

OTHER_LOOP = {"overlap": "normal", "normal": "overlap"}  # the dynamic workload runs in both loops
BUILTIN = "default"

Progress = Callable[[str], None]


# -- input validation --------------------------------------------------------------------------


def _power_of_two(value: int) -> bool:
    return value >= 1 and not value & (value - 1)


def parse_injections(texts: Iterable[str]) -> dict[str, int]:
    """`["tree_cache.page_size=1"]` -> `{"tree_cache": 1}`; bad input raises `MemcliError`."""
    example = "for example --inject tree_cache.page_size=1; components: " + ", ".join(COMPONENTS)
    out: dict[str, int] = {}
    for text in texts:
        key, sep, raw = text.partition("=")
        component, dot, attr = key.strip().partition(".")
        if not sep or not dot or attr != "page_size":
            raise MemcliError(f"--inject {text!r}: expected COMPONENT.page_size=N", hint=example)
        if component not in COMPONENTS and component not in BLOCK_HOLDERS:
            raise MemcliError(f"--inject {text!r}: unknown component {component!r}",
                              hint="components: " + ", ".join(COMPONENTS))
        try:
            value = int(raw.strip())
        except ValueError:
            raise MemcliError(f"--inject {text!r}: page size {raw.strip()!r} is not an integer", hint=example) from None
        out[component] = value
    check_injections(out)
    return out


def check_injections(injections: Mapping[str, int]) -> None:
    for component, value in injections.items():
        if component not in COMPONENTS and component not in BLOCK_HOLDERS:
            raise MemcliError(f"cannot inject a page size into {component!r}",
                              hint="components: " + ", ".join(COMPONENTS))
        if not isinstance(value, int) or not _power_of_two(value):
            raise MemcliError(f"--inject {component}.page_size={value}: a page size is a power of two",
                              hint="use 1, 2, 4, ..., 64, 128")


def _check_holders(injections: Mapping[str, int], holders) -> None:
    for component in injections:
        if component not in holders:
            raise MemcliError(f"cannot inject a page size into {component!r}: this engine has no such holder",
                              hint="components: " + ", ".join(holders))


def resolve_page_sizes(config: Config, page_sizes: Optional[Sequence[int]]) -> list[int]:
    """The page sizes to run (the config's when none given), de-duplicated, in order."""
    sizes = list(dict.fromkeys(page_sizes or [config.page_size]))
    for ps in sizes:
        if not isinstance(ps, int) or not _power_of_two(ps):
            raise MemcliError(f"--page-size {ps}: a page size is a power of two",
                              hint="for example --page-size 1 16 64")
    return sizes


# -- the run -----------------------------------------------------------------------------------


def run_check_page_size(config: Config, page_sizes: Optional[Sequence[int]] = None,
                        injections: Optional[Mapping[str, int]] = None, workload: str | Path = BUILTIN,
                        steps: int = DEFAULT_STEPS, fault_hook: Optional[FaultHook] = None,
                        requests: int = TRACE_DEFAULT_REQUESTS,
                        progress: Optional[Progress] = None, allow_unfinished: bool = False) -> CheckPageSizeResult:
    """Run static and dynamic checks at each page size (see the module docstring).

    `workload` is "default" (the built-in workload) or a trace file, of which the first
    `requests` requests are replayed. `steps` bounds each phase (0: static checks only);
    requests it leaves unfinished make the exit code 1 unless `allow_unfinished`.
    `fault_hook(scheduler, step_record)` runs after every step of the main phase, before the
    checks: tests plant faults with it. Raises `MemcliError` for bad input.
    """
    sizes = resolve_page_sizes(config, page_sizes)
    injections = dict(injections or {})
    check_injections(injections)
    if steps < 0:
        raise MemcliError(f"--steps {steps}: must be 0 or more", hint="0 runs the static checks only")
    if requests < 1:
        raise MemcliError(f"--requests {requests}: must be at least 1", hint="the first N requests of the trace")
    trace = None if str(workload) == BUILTIN else trace_workload(workload, requests)
    runs = []
    for ps in sizes:
        cfg = config if ps == config.page_size else replace(config, memory={"page_size": ps})
        runs.append(_run_page_size(cfg, injections, trace, steps, fault_hook, progress))
    name = trace.description if trace is not None else BUILTIN
    return CheckPageSizeResult(name, steps, injections, runs, config.semantics.label, allow_unfinished)


def _run_page_size(config: Config, injections: dict[str, int], trace: Optional[Workload], steps: int,
                   fault_hook: Optional[FaultHook], progress: Optional[Progress]) -> PageSizeRun:
    holders = getattr(engines.get(config).build_stack(config).memory.stack, "block_size_holders", None)
    if holders is not None:  # a block manager (vLLM's): its own holders and checks
        _check_holders(injections, holders)
        return run_block_page_size(config, injections, trace, steps)
    _check_holders(injections, COMPONENTS)
    static_config, static_adjustments = indices_only(config)
    engine = engines.get(static_config)
    stack = engine.build_stack(static_config, page_size_overrides=injections)
    if not hasattr(stack, "page_sizes"):
        raise MemcliError(f"check-page-size inspects a stack of page-size holders; engine {engine.name}'s memory"
                          f" ({type(stack.memory).__name__}) is not one yet",
                          hint="run check-page-size with --engine sglang-0.5.5")
    static = static_checks(stack)
    if trace is not None:
        dyn_config, dyn_adjustments, workload = static_config, static_adjustments, trace
        check_fits(dyn_config, workload.requests, workload.name, fewer_flag="--requests")
    else:
        dyn_config, dyn_adjustments = builtin_config(config)
        workload = builtin_workload(config.runtime.seed)
    phases = []
    if steps > 0:
        dyn_stack = stack if dyn_config is static_config else engines.get(dyn_config).build_stack(
            dyn_config, page_size_overrides=injections)
        kind, loop = dyn_config.cache.kind, dyn_config.behaviour.event_loop
        phases.append(run_phase(f"workload ({kind} cache, {loop} loop)", dyn_stack, dyn_config, workload, steps,
                                fault_hook, progress))
        _report(progress, config.page_size, phases[-1])
        bench = bench_workload(dyn_config)
        # The bench path has no tree cache of its own: its tree cache is the null cache.
        bench_injections = {k: v for k, v in injections.items() if k not in ("tree_cache", "host_pool")}
        bench_stack = engines.get(dyn_config).build_stack(dyn_config, cache_kind="none",
                                                          page_size_overrides=bench_injections)
        phases.append(run_phase(f"bench path (null cache, {loop} loop)", bench_stack, dyn_config, bench,
                                bench.step_bound))
        _report(progress, config.page_size, phases[-1])
        # The same workload in the other scheduler loop (the lag of overlap moves every free).
        other = replace(dyn_config, semantics={"event_loop": OTHER_LOOP[loop]})
        other_stack = engines.get(other).build_stack(other, page_size_overrides=injections)
        phases.append(run_phase(f"workload ({kind} cache, {OTHER_LOOP[loop]} loop)", other_stack, other, workload,
                                steps, progress=progress))
        _report(progress, config.page_size, phases[-1])
    return PageSizeRun(config.page_size, static, page_cost(config), static_adjustments, dyn_adjustments, phases,
                       _notes(config, injections), workload.steps_one_by_one(_chunk_tokens(dyn_config)))


def _chunk_tokens(config: Config) -> int:
    """The most prompt tokens one prefill step takes from a request: the chunk size and the
    prefill budget, floored to a page."""
    s, ps = config.scheduler, config.page_size
    budget = min(s.chunked_prefill_size or s.max_prefill_tokens, s.max_prefill_tokens)
    return max(align_down(budget, ps), ps)


def _report(progress: Optional[Progress], page_size: int, phase: PhaseResult) -> None:
    if progress is not None:
        verdict = "ok" if phase.ok else f"first violation at step {phase.violation.step}: {phase.violation.name}"
        progress(f"page size {page_size}, {phase.name}: {phase.steps} steps in {phase.seconds:.1f} s, {verdict}")


def _notes(config: Config, injections: dict[str, int]) -> list[str]:
    notes = []
    if injections:
        listed = ", ".join(f"{k}.page_size={v}" for k, v in injections.items())
        notes.append(f"injected (debugging only, the config keeps one page size {config.page_size}): {listed}")
    if "null_cache" in injections and config.cache.kind != "none":
        notes.append("the null cache is the bench path's tree cache: its injection shows in the bench phase")
    return notes
