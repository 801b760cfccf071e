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
    sweep: List[str] = typer.Option(
        [], "--sweep", metavar="KEY=V1,V2,...",
        help="A study: one replay per value of a config key (repeat it: every combination of the keys)"),
    sweep_file: Optional[Path] = typer.Option(
        None, "--sweep-file", metavar="FILE",
        help="A study of the points in a YAML list (each a mapping of config overrides)"),
    jobs: Optional[int] = typer.Option(
        None, "--jobs", "-j", metavar="N",
        help="Points run at once in local processes (default: the core count; 1: one after another)"),
    use_ray: bool = typer.Option(False, "--ray", help="Run each point as a Ray task (pip install 'memcli[ray]')"),
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", metavar="ADDR",
        help="Ray cluster to join with --ray (default: RAY_ADDRESS, else a local runtime)"),
    out: Optional[Path] = typer.Option(
        None, "--out", metavar="DIR", help="Folder for a study's study.json and study.csv, written as points finish"),
    resume: bool = typer.Option(False, "--resume", help="With --out: skip the points already in DIR/study.json"),
    bound: Optional[str] = typer.Option(
        None, "--bound", metavar="belady",
        help="Replay again under Belady's offline eviction and report its hit rate beside (a study: every point)"),
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
    --sweep runs a study: one replay per point, in parallel processes or on Ray."""
    from memcli.cli.progress import bars, wanted
    from memcli.config import ignored_keys, load_config
    from memcli.report.console import print_json, stdout_console
    from memcli.tools.replay.ceiling import shared_prefix_lens
    from memcli.cli.study import check_study_options, run_study_command, study_points
    from memcli.tools.replay.bound import bound_config
    from memcli.tools.replay.plot import check_plot_path, plot_replay, plot_study, require_matplotlib
    from memcli.tools.replay.report import render_replay, render_study, replay_document
    from memcli.tools.replay.requests import check_requests_out, write_requests
    from memcli.tools.replay.runner import ReplayOptions, check_options, default_arrivals, replay
    from memcli.tools.replay.study import StudyContext, with_belady
    from memcli.workload.readers import read_trace

    if arrivals is not None and arrivals not in ARRIVALS:
        raise MemcliError(f'unknown --arrivals "{arrivals}"', f"use one of: {', '.join(ARRIVALS)}")
    if plot is not None:
        check_plot_path(plot)
        require_matplotlib()
    if bound is not None and bound != "belady":
        raise MemcliError(f'unknown --bound "{bound}"', "the one bound is belady: --bound belady")
    points = study_points(sweep, sweep_file)
    check_study_options(points is not None, jobs, use_ray, ray_address, out, resume, events)
    if points is not None and requests_out is not None:
        raise MemcliError("--requests-out writes what one replay did; it cannot be combined with --sweep or"
                          " --sweep-file",
                          "leave out --sweep / --sweep-file, or --requests-out")
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
        if points is not None:
            make_config = lambda extra: load_config(config, [*set_, *extra], builtin="replay")  # noqa: E731
            doc = run_study_command(with_belady(points, bound is not None), make_config,
                                    StudyContext(trace, options, shared), jobs, use_ray, ray_address, out, resume,
                                    task)
            result = None
            failed = any(not entry["integrity_ok"] or entry["stalled"] for entry in doc["points"])
            _emit(json_out, doc, lambda console: render_study(doc, console))
            if plot is not None:
                plot_study(doc, plot)
        else:
            belady_cfg = bound_config(cfg) if bound is not None else None
            result = replay(cfg, trace, options, progress_for("replay"), shared)
            failed = not result.integrity.ok or result.stop is not None
            if requests_out is not None:
                count = write_requests(requests_out, result.requests_log, trace)
                print(f"requests: wrote {count:,} rows to {requests_out}", file=sys.stderr)
            bound_result = None
            if belady_cfg is not None and result.stop is None:
                bound_result = result if belady_cfg is cfg else replay(
                    belady_cfg, trace, ReplayOptions(options.arrivals), progress_for("belady bound"), shared)
            _emit(json_out, {**replay_document(result, bound=bound_result), "ignored_keys": sorted(ignored)},
                  lambda console: render_replay(result, console, bound=bound_result))
            if plot is not None and result.stop is None:
                plot_replay(result, plot)
    if plot is not None and (result is None or result.stop is None):
        print(f"plot: wrote {plot}", file=sys.stderr)
    if result is not None and result.stop is not None:
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
