"""`memcli bench-one-batch`: static batches through the real stack, timed phase by phase.

Options that take several values accept `--batch-size 1 8 32`, `--batch-size 1,8,32` or a
repeated flag (see `memcli.cli.options`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from memcli.cli.guard import note_ignored
from memcli.cli.options import EngineOpt, with_engine, LIST_METAVAR, ConfigOpt, JsonOpt, ProgressOpt, SetOpt, parse_ints
from memcli.tools.bench_one_batch import (DEFAULT_BATCH_SIZES, DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN, DEFAULT_ROUNDS,
                                          interpret_without_cuda)

NAME = "bench-one-batch"
LIST_FLAGS = ("--batch-size", "-b", "--input-len", "--output-len", "--prefix-len", "--page-size")


def bench_one_batch(
    config: Optional[Path] = ConfigOpt,
    set_: List[str] = SetOpt,
    engine: Optional[str] = EngineOpt,
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
        help="Time another implementation's own memory path beside memcli's in the same rounds: sglang-0.5.5"
             " (SGLang 0.5.5's stack), vllm-0.33 (vLLM 0.33's KVCacheManager, with --engine vllm-0.33)"),
    compare_backend: Optional[str] = typer.Option(
        None, "--compare-backend", metavar="NAME",
        help="SGLang's attention backend under --compare (default: what its server picks on the device, e.g. fa3"
             " on an H200, torch_native on a CPU; torch_native on CUDA times SGLang's fallback path)"),
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
        interpret_without_cuda()  # before the stack (and its kernels) is imported
    from memcli.cli.progress import lines, wanted
    from memcli.config import ignored_keys, load_config
    from memcli.report.console import print_json, stdout_console
    from memcli.tools.bench_one_batch.report import outcome_document, render_outcome
    from memcli.tools.bench_one_batch.run import BenchRequest, Hooks, run_bench_one_batch

    cfg = load_config(config, with_engine(set_, engine))
    ignored = ignored_keys(cfg, NAME)
    note_ignored(ignored, NAME)
    request = BenchRequest(
        cfg, _ints("--batch-size", batch_size, DEFAULT_BATCH_SIZES), _ints("--input-len", input_len, [DEFAULT_INPUT_LEN]),
        _ints("--output-len", output_len, [DEFAULT_OUTPUT_LEN]), _ints("--prefix-len", prefix_len, [0]),
        _ints("--page-size", page_size, None), tree_cache=tree_cache, repeat=repeat, warmup=warmup, rounds=rounds,
        run_name=run_name, compare=compare, result_file=result_file, compare_backend=compare_backend)
    outcome = run_bench_one_batch(request, Hooks(say=lines(wanted(progress)), note=_note))
    if json_out:
        print_json(outcome_document(outcome, sorted(ignored)))
    else:
        render_outcome(outcome, stdout_console())
    if outcome.idle_failures:
        print(f"idle check failed after: {'; '.join(outcome.idle_failures)} (memory not accounted for)",
              file=sys.stderr)
        raise typer.Exit(1)


def _ints(option: str, values: Optional[List[str]], default) -> Optional[tuple[int, ...]]:
    ints = parse_ints(option, values, None if default is None else list(default))
    return None if ints is None else tuple(ints)


def _note(line: str) -> None:
    print(f"note: {line}", file=sys.stderr)
