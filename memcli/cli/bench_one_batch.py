"""`memcli bench-one-batch`: static batches through the real stack, timed phase by phase.

Options that take several values accept `--batch-size 1 8 32`, `--batch-size 1,8,32` or a
repeated flag (see `memcli.cli.options`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from memcli.cli.guard import note_ignored
from memcli.cli.options import LIST_METAVAR, ConfigOpt, JsonOpt, ProgressOpt, SetOpt, parse_ints
from memcli.errors import MemcliError

NAME = "bench-one-batch"
LIST_FLAGS = ("--batch-size", "-b", "--input-len", "--output-len", "--prefix-len", "--page-size")
TREE_CACHES = ("none", "chunk", "radix", "hiradix")
# Defaults that fit the built-in config (16,384-token pool, 64 request rows) and run in a
# few seconds on a CPU. SGLang's own defaults (bs 1, input 1024, output 16) fit too.
DEFAULT_BATCH_SIZES = [1, 8]
DEFAULT_INPUT_LEN = 512
DEFAULT_OUTPUT_LEN = 16
DEFAULT_REPEAT = {"cuda": 10, "cpu": 5}
DEFAULT_ROUNDS = 7
COMPARE_CHOICES = ("sglang-0.5.5",)


def bench_one_batch(
    config: Optional[Path] = ConfigOpt,
    set_: List[str] = SetOpt,
    batch_size: Optional[List[str]] = typer.Option(
        None, "--batch-size", "-b", metavar=LIST_METAVAR, help="Batch sizes, e.g. 1 8 32 or 1,8,32 (default 1 8)"),
    input_len: Optional[List[str]] = typer.Option(
        None, "--input-len", metavar=LIST_METAVAR, help=f"Prompt tokens per request (default {DEFAULT_INPUT_LEN})"),
    output_len: Optional[List[str]] = typer.Option(
        None, "--output-len", metavar=LIST_METAVAR, help=f"Decode steps per request (default {DEFAULT_OUTPUT_LEN})"),
    prefix_len: Optional[List[str]] = typer.Option(
        None, "--prefix-len", metavar=LIST_METAVAR, help="Prompt tokens per request already cached (default 0)"),
    page_size: Optional[List[str]] = typer.Option(
        None, "--page-size", metavar=LIST_METAVAR, help="Page sizes to compare (default: the config's memory.page_size)"),
    tree_cache: str = typer.Option(
        "none", "--tree-cache",
        help="Prefix cache: none, chunk or radix; hiradix times the host tier's backup and load-back of the batch"
             " (GB/s beside a plain copy of the same bytes)"),
    repeat: Optional[int] = typer.Option(
        None, "--repeat", help="Timed calls per phase in each round (default 10 on a GPU, 5 on a CPU)"),
    rounds: int = typer.Option(
        DEFAULT_ROUNDS, "--rounds", help="Rounds over every case; each phase reports the median of its round medians"),
    compare: Optional[str] = typer.Option(
        None, "--compare", metavar="IMPL",
        help="Time SGLang 0.5.5's own memory path beside memcli's in the same rounds (sglang-0.5.5)"),
    warmup: int = typer.Option(2, "--warmup", help="Untimed calls per phase before the timed ones"),
    run_name: str = typer.Option("default", "--run-name", help="run_name field of every result"),
    result_file: Optional[Path] = typer.Option(None, "--result-file", metavar="FILE", help="Append one JSON line per case"),
    json_out: bool = JsonOpt,
    progress: bool = ProgressOpt,
) -> None:
    """Time one static batch through the real stack: prefill, decode steps and finish.

    Every combination of the listed values is one case; each case times the memory path
    (allocation, index writes, frees), the KV store and each phase, and checks the idle stack."""
    if compare is not None:
        _interpret_without_cuda()  # before the stack (and its kernels) is imported
    from memcli.cli.progress import lines, wanted
    from memcli.config import ignored_keys, load_config
    from memcli.report.console import print_json, stdout_console
    from memcli.tools.bench_one_batch.cases import plan_cases
    from memcli.tools.bench_one_batch.report import bench_document, render
    from memcli.tools.bench_one_batch.run import run_bench_one_batch

    cfg = load_config(config, set_)
    ignored = ignored_keys(cfg, NAME)
    note_ignored(ignored, NAME)
    cases = plan_cases(
        parse_ints("--batch-size", batch_size, DEFAULT_BATCH_SIZES),
        parse_ints("--input-len", input_len, [DEFAULT_INPUT_LEN]),
        parse_ints("--output-len", output_len, [DEFAULT_OUTPUT_LEN]),
        parse_ints("--prefix-len", prefix_len, [0]),
        parse_ints("--page-size", page_size, [cfg.page_size]),
    )
    options = _options(tree_cache, repeat, warmup, rounds, run_name, cfg)
    if tree_cache == "hiradix":
        _hiradix(cfg, cases, options, compare, result_file, json_out, sorted(ignored), progress)
        return
    _check_result_file(result_file)
    comparison = _comparison(compare, cfg)
    if comparison is not None:
        for line in comparison.slow_start_notes(cases):
            print(f"note: {line}", file=sys.stderr)
    say = lines(wanted(progress))
    result = run_bench_one_batch(cfg, cases, options, progress=_progress(say) if say else None, comparison=comparison)
    if result_file is not None:
        _append_results(result_file, result)
    if json_out:
        print_json(bench_document(result, sorted(ignored)))
    else:
        render(result, stdout_console())
    failed = [r.case.label for r in result.cases if not r.idle.get("ok")]
    if failed:
        print(f"idle check failed after: {'; '.join(failed)} (memory not accounted for)", file=sys.stderr)
        raise typer.Exit(1)


def _hiradix(cfg, cases, options, compare, result_file, json_out: bool, ignored: list, progress: bool) -> None:
    """The host tier's copies (memcli.tools.bench_one_batch.hicache_bench), one table or document."""
    from memcli.cli.progress import lines, wanted
    from memcli.report.console import print_json, stdout_console
    from memcli.tools.bench_one_batch.hicache_bench import render_transfers, run_transfer_bench

    if compare is not None or result_file is not None:
        raise MemcliError("--tree-cache hiradix times host copies only: --compare and --result-file do not apply",
                          hint="leave out --compare and --result-file")
    say = lines(wanted(progress))
    report = (lambda r, n, case: say(f"round {r}/{n}: {case.label}")) if say else None
    bench = run_transfer_bench(cfg, cases, options.repeat, options.warmup, options.rounds, report)
    if json_out:
        print_json(bench.to_document(ignored))
    else:
        render_transfers(bench, stdout_console())


def _interpret_without_cuda() -> None:
    """SGLang's Triton kernels run in the interpreter on a machine without CUDA. Triton
    settles that when the first kernel is decorated, so it is set before any is imported."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _comparison(compare: Optional[str], cfg):
    """SGLang's side of `--compare`, from the cached wheel (exit 2 with the fetch command when absent)."""
    if compare is None:
        return None
    if compare not in COMPARE_CHOICES:
        raise MemcliError(f"--compare {compare!r}: unknown", hint=f"use one of {', '.join(COMPARE_CHOICES)}")
    from memcli.reference.fetch import cached_wheel, reference_dir
    if cached_wheel() is None:
        raise MemcliError(f"--compare {compare}: the sglang 0.5.5 wheel is not in {reference_dir()}",
                          hint="fetch it once with `memcli reference fetch` (3.4 MB from PyPI; MEMCLI_CACHE_DIR moves"
                               " the cache)")
    from memcli.reference.loader import load_reference
    from memcli.devices import resolve_device
    from memcli.tools.bench_one_batch.sglang_side import SglangComparison
    return SglangComparison(load_reference(), resolve_device(cfg))


def _options(tree_cache: str, repeat: Optional[int], warmup: int, rounds: int, run_name: str, cfg):
    from memcli.devices import resolve_device
    from memcli.tools.bench_one_batch.run import BenchOptions

    if tree_cache not in TREE_CACHES:
        raise MemcliError(f"--tree-cache {tree_cache!r}: unknown", hint=f"use one of {', '.join(TREE_CACHES)}")
    if repeat is None:
        repeat = DEFAULT_REPEAT[resolve_device(cfg).type]
    if repeat < 1 or warmup < 0 or rounds < 1:
        raise MemcliError(f"--repeat {repeat} / --warmup {warmup} / --rounds {rounds}: out of range",
                          hint="--repeat and --rounds must be at least 1, --warmup at least 0")
    return BenchOptions(tree_cache=tree_cache, repeat=repeat, warmup=warmup, rounds=rounds, run_name=run_name,
                        seed=cfg.runtime.seed)


def _check_result_file(path: Optional[Path]) -> None:
    if path is None:
        return
    if path.is_dir() or not path.parent.is_dir():
        raise MemcliError(f"--result-file {path}: cannot append to it",
                          hint="give a file path in an existing folder (it is created if missing)")


def _append_results(path: Path, result) -> None:
    with path.open("a") as f:
        for case in result.cases:
            f.write(json.dumps(case.to_dict()) + "\n")


def _progress(say):
    """One line per round, on stderr."""
    def report(round_number: int, rounds: int, number: int, cases: int, case) -> None:
        if number == 1:
            say(f"{NAME}: round {round_number}/{rounds} over {cases} case(s)")
    return report
