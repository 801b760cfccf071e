"""bench-one-batch: the rounds over the cases, each case timed phase by phase through the real stack.

`run_cases` checks that every case fits before running any, builds one stack per
page size (the config's, with the chosen tree cache), and runs each case with `run_case`:

1. prefill: `prepare_for_extend` + KV store, then the memory path alone (`alloc_for_extend`),
   then the KV store alone and a plain device copy of the same bytes;
2. `output_len` decode steps, each timed as `prepare_for_decode` + KV store and as the memory
   path alone (`alloc_for_decode`), from the same state; on a GPU the launch floor (one
   graph replay of one tiny kernel) is timed call by call in turn with each memory path, so
   the ratio of the two is taken under the same state of the machine;
3. finish: every request released (one free), then the idle stack is checked.

Statistics: the whole set of cases runs `rounds` times, cases interleaved within each round
(one stack per page size, built afresh each round), so host noise falls on every case
alike; each phase is timed as `repeat` calls per round and reported as the median of the
round medians with its spread (`phases.combine_rounds`). With a `Comparison` (SGLang's own
memory path), its run of each case follows memcli's in the same round.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from memcli.tools.bench_one_batch.blocks import run_block_case
from memcli.tools.bench_one_batch.cases import Case, check_cases_fit
from memcli.tools.bench_one_batch.phases import PhaseTiming, combine_rounds, combine_steps, measure, measure_beside
from memcli.tools.bench_one_batch.results import (BenchResult, CaseResult, KVStoreFigures, ReferenceResult,
                                                  combine_case_rounds)
from memcli.tools.bench_one_batch.runner import CaseRunner
from memcli.config import GIB, Config, replace
from memcli import engines
from memcli.devices import resolve_device
from memcli.timing import torch_threads, wall_time

# (round, rounds, case number, cases, case), before each case of each round (numbers from 1).
Progress = Callable[[int, int, int, int, Case], None]


class Comparison(Protocol):
    """Another implementation of the memory path, timed beside memcli's in the same rounds."""

    name: str
    setup: str  # what the reference runs, in words, where no attention backend names it ("" otherwise)

    def run_case(self, case: Case, config: Config, options: "BenchOptions",
                 floor: Optional["GraphFloor"] = None) -> dict[str, PhaseTiming]:
        """The phases `prefill_memory`, `decode_memory` (when the case decodes) and `free`;
        with a `floor`, the decode memory path timed in turn with it, as memcli's is."""
        ...

    def slow_start_notes(self, cases: list[Case]) -> list[str]:
        """Lines to print before the run when these cases will be slow to start on its side."""
        ...

    def check_case(self, case: Case, mine: CaseResult) -> None:
        """Raise `IntegrityError` when its last run of `case` did other work than memcli's `mine`."""
        ...

# Share of the free device memory the K/V sources of the store may take.
SOURCE_MEMORY_SHARE = 0.9


@dataclass(frozen=True)
class BenchOptions:
    """How to run the cases: `rounds` rounds over every case, each phase timed as `repeat`
    calls per round after `warmup` untimed ones."""

    tree_cache: str = "none"
    repeat: int = 5
    warmup: int = 2
    rounds: int = 7
    run_name: str = "default"
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def case_configs(config: Config, cases: Sequence[Case], tree_cache: str) -> dict[int, Config]:
    """The config of each page size: `config` with that page size and the chosen tree cache."""
    page_sizes = dict.fromkeys(c.page_size for c in cases)
    return {ps: replace(config, memory={"page_size": ps}, cache={"kind": tree_cache}) for ps in page_sizes}


def run_cases(config: Config, cases: Sequence[Case], options: BenchOptions,
                        progress: Optional[Progress] = None,
                        comparison: Optional[Comparison] = None) -> BenchResult:
    """Run every case `options.rounds` times; raises `CapacityError` before running anything
    if one cannot fit."""
    configs = case_configs(config, cases, options.tree_cache)
    check_cases_fit(cases, configs)
    device = resolve_device(config)
    rounds: dict[Case, list[CaseResult]] = {case: [] for case in cases}
    floor = GraphFloor(device) if device.type == "cuda" else None
    floor_rounds: list[PhaseTiming] = []  # per round: every case's launch floor, combined
    compared: dict[Case, list[dict[str, PhaseTiming]]] = {case: [] for case in cases}
    with torch_threads(device):
        for round_number in range(1, options.rounds + 1):
            done = 0
            for ps, cfg in configs.items():
                stack = engines.get(cfg).build_stack(cfg)
                for case in (c for c in cases if c.page_size == ps):
                    done += 1
                    if progress is not None:
                        progress(round_number, options.rounds, done, len(cases), case)
                    rounds[case].append(run_case(stack, case, options, floor))
                    if comparison is not None:
                        compared[case].append(comparison.run_case(case, cfg, options, floor))
                        comparison.check_case(case, rounds[case][-1])
                del stack
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            floors = [rounds[case][-1].phases["launch_floor"] for case in cases
                      if "launch_floor" in rounds[case][-1].phases]
            if floors:
                floor_rounds.append(combine_steps(floors))
    results = [combine_case_rounds(rounds[case]) for case in cases]
    reference = None
    if comparison is not None:
        reference = ReferenceResult(comparison.name, [
            {name: combine_rounds([r[name] for r in compared[case]]) for name in compared[case][0]}
            for case in cases], comparison.backend.name, comparison.backend.label, comparison.setup)
    method = results[0].timing_method if results else ""
    shown = replace(config, cache={"kind": options.tree_cache})
    return BenchResult(shown, options.to_dict(), describe_device(device), method, results, reference,
                       combine_rounds(floor_rounds) if floor_rounds else None)


class GraphFloor:
    """The floor of any path that launches work: replaying a CUDA graph of one tiny kernel
    (one add on one element). Its calls are timed in turn with each decode step's memory
    path's, so the two figures see the same state of the machine."""

    def __init__(self, device: torch.device):
        self.device = device
        self.x = torch.zeros(1, dtype=torch.int64, device=device)
        self.x.add_(1)  # load the kernel before the capture
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.x.add_(1)

    def replay(self) -> None:
        self.graph.replay()


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu (one torch thread)"


def run_case(stack: Any, case: Case, options: BenchOptions, floor: Optional[GraphFloor] = None) -> CaseResult:
    """One case on `stack` (built with the case's page size); leaves the stack idle. With a
    `floor`, the launch floor is timed beside the decode memory path (`launch_floor`)."""
    if engines.get(stack.config).static_batch is not None:
        return run_block_case(stack, case, options)
    runner = CaseRunner(stack, case, seed=options.seed)
    timed = functools.partial(measure, device=stack.device, repeat=options.repeat, warmup=options.warmup)
    runner.start()
    note = _kv_store_note(runner)
    if note is None:
        runner.alloc_kv_sources()
    phases, kv_prefill = _measure_prefill(runner, timed, options)
    allocated = stack.memory.in_use_tokens - runner.in_use_before_prefill
    steps, floors, decode_allocated = _measure_decode(runner, timed, options, floor)
    kv_decode = _measure_decode_store(runner, timed)
    runner.free_kv_sources()
    in_use = stack.memory.in_use_tokens
    phases["free"] = timed(runner.finish, setup=runner.before_finish)
    if steps:
        phases["decode_step"] = combine_steps([s for s, _ in steps])
        phases["decode_memory"] = combine_steps([m for _, m in steps])
    if floors:
        phases["launch_floor"] = combine_steps(floors)
    for name, figures in (("kv_store_prefill", kv_prefill), ("kv_store_decode", kv_decode)):
        if figures is not None:
            phases[name] = figures.store
    if kv_prefill is not None:
        phases["copy_prefill"] = kv_prefill.copy
    return CaseResult(
        run_name=options.run_name, case=case, tree_cache=options.tree_cache, device=str(stack.device),
        backend=stack.backend, timing_method=phases["prefill"].method,
        cached_prefix_len=runner.prefix_lens[0], prefill_new_tokens=runner.new_tokens,
        prefill_allocated_tokens=allocated, decode_allocated_tokens=decode_allocated,
        freed_tokens=in_use - stack.memory.in_use_tokens, page_sizes=stack.page_sizes(), phases=phases,
        decode_step_us=[s.median_us for s, _ in steps], kv_store_prefill=kv_prefill, kv_store_decode=kv_decode,
        kv_store_note=note, idle=idle_state(stack),
    )


def _measure_prefill(runner: CaseRunner, timed, options: BenchOptions
                     ) -> tuple[dict[str, PhaseTiming], Optional[KVStoreFigures]]:
    """The memory path (on a GPU's graph path in turn with its floor, the same extend as a
    bare replay: `MemoryManager.bare_extend`),
    the KV store alone, a plain copy, then the whole prefill.

    The case's first prefill (its wall time reported as the memory path's first call: the
    prefix warm-up's prefill when there is a prefix, else the batch's first) compiles the
    memory path's kernels, and the first KV store compiles the store, so each phase's first
    call shows its own compilation. Leaves the batch after one prefill.
    """
    first_s = wall_time(runner.batch.prepare_for_extend, runner.device)
    if runner.warm_prefill_s is not None:  # the prefix warm-up made the case's first prefill
        first_s = runner.warm_prefill_s
    rows = [req.kv.req_pool_idx for req in runner.reqs]
    runner.restore_prefill()  # the floor starts where the extend starts
    floor = runner.memory.bare_extend(runner.batch.extend_plan, rows)
    kv = None
    if runner.store_kv:
        tokens = runner.new_tokens
        kv = KVStoreFigures(tokens, tokens * runner.stack.kv_pool.bytes_per_token,
                            timed(runner.store_prefill_kv), timed(runner.copy_prefill_kv))
    memory, extend_floor = measure_beside(runner.prefill_memory, None if floor is None else floor.replay,
                                          runner.device, options.repeat, options.warmup,
                                          setup=runner.restore_prefill, first_call_s=first_s)
    phases = {"prefill_memory": memory, "prefill": timed(runner.prefill, setup=runner.restore_prefill)}
    if extend_floor is not None:
        phases["extend_floor"] = extend_floor
    return phases, kv


def _measure_decode(runner: CaseRunner, timed, options: BenchOptions, floor: Optional[GraphFloor]
                    ) -> tuple[list[tuple[PhaseTiming, PhaseTiming]], list[PhaseTiming], int]:
    """(step, memory path) timings of every decode step, each from the state before it, and
    with a `floor` the launch floor timed call by call in turn with each step's memory path."""
    steps, floors = [], []
    before = runner.memory.in_use_tokens
    for _ in range(runner.decode_steps):
        restore = functools.partial(runner.restore_decode, runner.snapshot_decode())
        memory, launch = measure_beside(runner.decode_memory, None if floor is None else floor.replay,
                                        runner.device, options.repeat, options.warmup, setup=restore)
        if launch is not None:
            floors.append(launch)
        steps.append((timed(runner.decode_step, setup=restore), memory))
    return steps, floors, runner.memory.in_use_tokens - before


def _measure_decode_store(runner: CaseRunner, timed) -> Optional[KVStoreFigures]:
    """The KV store of the last decode step alone (None without decode steps or store)."""
    if not runner.store_kv or runner.decode_steps == 0:
        return None
    tokens = runner.case.batch_size
    return KVStoreFigures(tokens, tokens * runner.stack.kv_pool.bytes_per_token, timed(runner.store_decode_kv))


def _kv_store_note(runner: CaseRunner) -> Optional[str]:
    """Why the KV store cannot be measured, or None when it can."""
    kv = runner.stack.kv_pool
    if not kv.materialized:
        return "KV store not measured: memory.kv_pool is 'indices' (no K/V buffers)"
    need = (runner.new_tokens + runner.case.batch_size) * kv.bytes_per_token
    if runner.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(runner.device)
        if need > SOURCE_MEMORY_SHARE * free:
            return (f"KV store not measured: the K/V of the new tokens take {need / GIB:.1f} GiB,"
                    f" {free / GIB:.1f} GiB of device memory is free")
    return None


def idle_state(stack: Any) -> dict:
    """Invariant 6 after the finish: every row free, available + evictable == size."""
    return stack.memory.idle_state()
