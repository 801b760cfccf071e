"""`memcli bench-one-batch`, end to end: the cases planned and checked, the memory-path rounds
(`rounds.run_cases`, with SGLang's own path beside them under `--compare`) or the host tier's
copies (`--tree-cache hiradix`, `host_tier_bench`), and the `--result-file` lines appended.

`run_bench_one_batch` is the entry. Under `--compare` on a machine without CUDA,
`memcli.tools.bench_one_batch.interpret_without_cuda` must run before this module is
imported (it imports the stack, and with it the kernels).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional

from memcli import engines
from memcli.config import Config
from memcli.errors import MemcliError
from memcli.devices import resolve_device
from memcli.tools.bench_one_batch import (COMPARE_CHOICES, DEFAULT_REPEAT, DEFAULT_ROUNDS, SGLANG_0523_COMPARE,
                                          TREE_CACHES, VLLM_COMPARE)
from memcli.tools.bench_one_batch.cases import Case, plan_cases
from memcli.tools.bench_one_batch.host_tier_bench import run_transfer_bench
from memcli.tools.bench_one_batch.results import BenchOutcome, BenchResult
from memcli.tools.bench_one_batch.rounds import BenchOptions, run_cases

NAME = "bench-one-batch"


@dataclass(frozen=True)
class BenchRequest:
    """What `memcli bench-one-batch` was asked: every combination of the listed values is one
    case (`page_sizes` None: the config's page size); `repeat` None: the device's default;
    `compare` None or an implementation of `COMPARE_CHOICES`; `result_file`: append one JSON
    line per case there."""

    config: Config
    batch_sizes: tuple[int, ...]
    input_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...] = (0,)
    page_sizes: Optional[tuple[int, ...]] = None
    tree_cache: str = "none"
    repeat: Optional[int] = None
    warmup: int = 2
    rounds: int = DEFAULT_ROUNDS
    run_name: str = "default"
    compare: Optional[str] = None
    result_file: Optional[Path] = None
    compare_backend: Optional[str] = None  # SGLang's attention backend (None: its default on the device)


def _quiet(line: str) -> None:
    return None


class Hooks(NamedTuple):
    """How a run reports while it runs: `say` gets a progress line per round (None: no
    progress); `note` a line to show before the run (what will be slow, and why)."""

    say: Optional[Callable[[str], None]] = None
    note: Callable[[str], None] = _quiet


def run_bench_one_batch(request: BenchRequest, hooks: Hooks = Hooks()) -> BenchOutcome:
    """Plan and check the cases, then time them: the memory-path rounds, or with
    `tree_cache` hiradix the host tier's copies. Raises `MemcliError` for bad input (a value
    out of range, a case that cannot fit, SGLang's wheel missing under `--compare`) before
    anything is timed."""
    cfg = request.config
    cases = plan_cases(request.batch_sizes, request.input_lens, request.output_lens, request.prefix_lens,
                       request.page_sizes or (cfg.page_size,))
    options = bench_options(request)
    if request.tree_cache == "hiradix":
        return BenchOutcome(transfers=_transfers(request, cases, options, hooks.say))
    _check_result_file(request.result_file)
    comparison = _comparison(request.compare, cfg, request.compare_backend, request.tree_cache)
    if comparison is not None:
        for line in comparison.slow_start_notes(cases):
            hooks.note(line)
    result = run_cases(cfg, cases, options, progress=_rounds(hooks.say) if hooks.say else None,
                       comparison=comparison)
    if request.result_file is not None:
        _append_results(request.result_file, result)
    return BenchOutcome(result=result)


def bench_options(request: BenchRequest) -> BenchOptions:
    """How the cases run, checked (`MemcliError` for a value out of range)."""
    if request.tree_cache not in TREE_CACHES:
        raise MemcliError(f"--tree-cache {request.tree_cache!r}: unknown", hint=f"use one of {', '.join(TREE_CACHES)}")
    repeat = request.repeat if request.repeat is not None else DEFAULT_REPEAT[resolve_device(request.config).type]
    warmup, rounds = request.warmup, request.rounds
    if repeat < 1 or warmup < 0 or rounds < 1:
        raise MemcliError(f"--repeat {repeat} / --warmup {warmup} / --rounds {rounds}: out of range",
                          hint="--repeat and --rounds must be at least 1, --warmup at least 0")
    return BenchOptions(tree_cache=request.tree_cache, repeat=repeat, warmup=warmup, rounds=rounds,
                        run_name=request.run_name, seed=request.config.runtime.seed)


def _transfers(request: BenchRequest, cases: list[Case], options: BenchOptions, say):
    """The host tier's copies (`host_tier_bench`)."""
    if request.compare is not None or request.result_file is not None:
        raise MemcliError("--tree-cache hiradix times host copies only: --compare and --result-file do not apply",
                          hint="leave out --compare and --result-file")
    report = (lambda r, n, case: say(f"round {r}/{n}: {case.label}")) if say else None
    return run_transfer_bench(request.config, cases, options.repeat, options.warmup, options.rounds, report)


def _comparison(compare: Optional[str], cfg: Config, backend: Optional[str] = None, tree_cache: str = "none"):
    """SGLang's side of `--compare`, from the cached wheel (exit 2 with the fetch command when absent),
    with the attention backend `backend` (None: SGLang's default on the device)."""
    if compare is None:
        if backend is not None:
            raise MemcliError("--compare-backend names SGLang's attention backend: it needs --compare",
                              hint="add --compare sglang-0.5.5, or leave out --compare-backend")
        return None
    if compare not in COMPARE_CHOICES:
        raise MemcliError(f"--compare {compare!r}: unknown", hint=f"use one of {', '.join(COMPARE_CHOICES)}")
    _check_compared_engine(compare, cfg)
    if compare == VLLM_COMPARE:
        return _vllm_comparison(backend, tree_cache != "none")
    if compare == SGLANG_0523_COMPARE:
        from memcli.tools.bench_one_batch.sglang_0523_side import load_comparison
        return load_comparison(resolve_device(cfg), backend)
    from memcli.reference.fetch import cached_wheel, reference_dir
    if cached_wheel() is None:
        raise MemcliError(f"--compare {compare}: the sglang 0.5.5 wheel is not in {reference_dir()}",
                          hint="fetch it once with `memcli reference fetch` (3.4 MB from PyPI; MEMCLI_CACHE_DIR moves"
                               " the cache)")
    from memcli.reference.loader import load_reference
    from memcli.tools.bench_one_batch.sglang_side import SglangComparison
    return SglangComparison(load_reference(), resolve_device(cfg), backend)


def _check_compared_engine(compare: str, cfg: Config) -> None:
    """The memcli side of a comparison must run the compared engine's kind of memory: vLLM's
    manager beside memcli's block manager, SGLang's stack beside memcli's stack."""
    engine = engines.get(cfg)
    blocks = engine.static_batch is not None
    if (compare == VLLM_COMPARE) != blocks:
        raise MemcliError(f"--compare {compare}: memcli runs engine {engine.name}, whose memory is not the kind"
                          f" {compare} has, so the two would not do the same work",
                          hint=f"add --engine {compare}" if compare == VLLM_COMPARE else
                          f"add --engine {compare} (or compare {VLLM_COMPARE} under --engine {VLLM_COMPARE})")


def _vllm_comparison(backend: Optional[str], caching: bool):
    """vLLM's real `KVCacheManager` from its wheel (fetched once; exit 2 with the reason when it cannot be)."""
    if backend is not None:
        raise MemcliError(f"--compare-backend {backend}: vLLM's KV-cache manager reads no attention backend",
                          hint=f"leave out --compare-backend with --compare {VLLM_COMPARE}")
    from memcli.reference.vllm033.loader import load_vllm, vllm_unavailable_reason
    reason = vllm_unavailable_reason()
    if reason is not None:
        raise MemcliError(f"--compare {VLLM_COMPARE}: vLLM's wheel is not available: {reason}",
                          hint="it is fetched once (pip download --no-deps vllm==0.33.0, 336 MB) into memcli's cache;"
                               " run where the package index is reachable (MEMCLI_CACHE_DIR moves the cache)")
    from memcli.tools.bench_one_batch.vllm_side import VllmComparison
    return VllmComparison(load_vllm(), caching)


def _check_result_file(path: Optional[Path]) -> None:
    if path is None:
        return
    if path.is_dir() or not path.parent.is_dir():
        raise MemcliError(f"--result-file {path}: cannot append to it",
                          hint="give a file path in an existing folder (it is created if missing)")


def _append_results(path: Path, result: BenchResult) -> None:
    with path.open("a") as f:
        for case in result.cases:
            f.write(json.dumps(case.to_dict()) + "\n")


def _rounds(say: Callable[[str], None]):
    """One line per round."""
    def report(round_number: int, rounds: int, number: int, cases: int, case: Case) -> None:
        if number == 1:
            say(f"{NAME}: round {round_number}/{rounds} over {cases} case(s)")
    return report
