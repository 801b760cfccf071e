"""`memcli replay TRACE`: continuous batching over a trace, on the config's stack and device."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from memcli.cli.guard import Interrupted, note_ignored
from memcli.cli.options import JsonOpt, ProgressOpt, SetOpt
from memcli.errors import MemcliError
from memcli.tools.replay import ARRIVALS
from memcli.workload import FORMATS


def replay_command(
    trace_path: Path = typer.Argument(..., metavar="TRACE", help="Trace file: memcli or Mooncake JSONL"),
    check_level: Optional[str] = typer.Argument(None, metavar="full", help="After --check: full", show_default=False),
    config: Optional[Path] = typer.Option(None, "--config", "-c", metavar="FILE",
                                          help="YAML config (default: the built-in replay config)"),
    set_: List[str] = SetOpt,
    trace_format: str = typer.Option("auto", "--format", metavar="FORMAT",
                                     help=f"Trace format: {', '.join(FORMATS)}"),
    block_size: int = typer.Option(512, "--block-size", help="Tokens per hash block (Mooncake 512, Qwen-Bailian 16)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="Replay only the first N requests"),
    arrivals: Optional[str] = typer.Option(
        None, "--arrivals", metavar="MODE",
        help="timestamp (trace times on the simulated clock; default when the trace has times),"
        " burst (all at t=0; default otherwise) or sequential (one request at a time)"),
    check: bool = typer.Option(
        False, "--check", help="Check integrity after every step, incrementally (what the step changed, plus sampled"
        " full walks on idle steps); `--check full`: the full walk of the pool after every step (slow on large pools)"),
    sweep: Optional[str] = typer.Option(None, "--sweep", metavar="KEY=V1,V2,...",
                                         help="One replay per value of a config key, one row each"),
    json_out: bool = JsonOpt,
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="PNG",
                                        help="Write occupancy and running requests over time (PNG)"),
    events: Optional[Path] = typer.Option(None, "--events", metavar="FILE",
                                          help="Write the KV events stream (JSON lines)"),
    requests_out: Optional[Path] = typer.Option(
        None, "--requests-out", metavar="FILE.csv|FILE.jsonl",
        help="Write one row per request: arrival, admission and finish on the simulated clock, queueing delay,"
        " input, output and cached tokens, retractions, aborted"),
    progress: bool = ProgressOpt,
) -> None:
    """Replay a trace through the memory stack and the scheduler with continuous batching.

    Reports prefix-cache hits, allocation, eviction, scheduling and the integrity checks;
    --sweep runs one replay per value of a config key."""
    from memcli.cli.progress import bars, wanted
    from memcli.config import ignored_keys, load_config
    from memcli.report.console import print_json, stdout_console
    from memcli.tools.replay.ceiling import shared_prefix_lens
    from memcli.tools.replay.plot import check_plot_path, plot_replay, plot_sweep, require_matplotlib
    from memcli.tools.replay.report import render_replay, render_sweep, replay_document, sweep_document
    from memcli.tools.replay.requests import check_requests_out, write_requests
    from memcli.tools.replay.runner import ReplayOptions, check_options, default_arrivals, replay
    from memcli.tools.replay.sweep import parse_sweep, run_sweep
    from memcli.workload.readers import read_trace

    if arrivals is not None and arrivals not in ARRIVALS:
        raise MemcliError(f'unknown --arrivals "{arrivals}"', f"use one of: {', '.join(ARRIVALS)}")
    if plot is not None:
        check_plot_path(plot)
        require_matplotlib()
    spec = parse_sweep(sweep) if sweep is not None else None
    for flag, value in (("--events", events), ("--requests-out", requests_out)):
        if spec is not None and value is not None:
            raise MemcliError(f"{flag} writes what one replay did; it cannot be combined with --sweep",
                              f"leave out --sweep, or {flag}")
    if requests_out is not None:
        check_requests_out(requests_out)
    cfg = load_config(config, set_, builtin="replay")
    ignored = ignored_keys(cfg, "replay")
    note_ignored(ignored, "replay")
    if check_level is not None and (check_level != "full" or not check):
        raise MemcliError(f'unexpected argument "{check_level}"', "the one word after TRACE is full, in --check full")
    show = wanted(progress)
    with bars(show) as task:
        trace = read_trace(trace_path, format=trace_format, block_size=block_size, limit=limit,
                           progress=_reading(task("reading the trace")) if show else None)
        options = ReplayOptions(arrivals or default_arrivals(trace), check, events,
                                check_level=check_level or "incremental")
        check_options(trace, cfg, options)
        progress_for = (lambda label: _replaying(task(label))) if show else (lambda label: None)
        shared = shared_prefix_lens(trace)
        if spec is not None:
            result = run_sweep(spec, lambda extra: load_config(config, [*set_, *extra], builtin="replay"), trace, options,
                               shared, progress_for)
            failed = any(not row.result.integrity.ok for row in result.rows)
            _emit(json_out, sweep_document(result), lambda console: render_sweep(result, console))
            if plot is not None:
                plot_sweep(result, plot)
        else:
            result = replay(cfg, trace, options, progress_for("replay"), shared)
            failed = not result.integrity.ok or result.stop is not None
            if requests_out is not None:
                count = write_requests(requests_out, result.requests_log, trace)
                print(f"requests: wrote {count:,} rows to {requests_out}", file=sys.stderr)
            _emit(json_out, {**replay_document(result), "ignored_keys": sorted(ignored)},
                  lambda console: render_replay(result, console))
            if plot is not None and result.stop is None:
                plot_replay(result, plot)
    if plot is not None and (spec is not None or result.stop is None):
        print(f"plot: wrote {plot}", file=sys.stderr)
    if spec is None and result.stop is not None:
        if result.interrupted:
            raise Interrupted(result.stop.message)
        print(f"error: {result.stop.message}", file=sys.stderr)
        print("hint: check the sim costs and the pool sizes; the result above covers the replay so far",
              file=sys.stderr)
    if failed:
        raise typer.Exit(1)


def _emit(json_out: bool, document: dict, render) -> None:
    from memcli.report.console import print_json, stdout_console

    if json_out:
        print_json(document)
    else:
        render(stdout_console())


def _reading(update):
    """Progress of reading a trace, in MB of the file as stored."""
    def report(done: int, size, requests: int) -> None:
        update(-(-done >> 20), None if size is None else max(-(-size >> 20), 1), f"MB, {requests:,} requests")
    return report


def _replaying(update):
    """Progress of one replay: requests finished, the simulated clock and the steps."""
    return lambda p: update(p.finished, p.total, f"sim {p.simulated_ms / 1e3:,.0f} s, {p.steps:,} steps")
