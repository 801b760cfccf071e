"""`memcli replay TRACE`: continuous batching over a trace, on the config's stack and device.

The options become a `ReplayRequest`; one replay is `memcli.tools.replay.run.run_replay`, a
study (`--sweep`, `--sweep-file`) `memcli.tools.study.run.run_study`. This module only
parses, calls one of them, and prints what came back.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from memcli.cli.guard import Interrupted, note_ignored
from memcli.cli.options import EngineOpt, with_engine, JsonOpt, ProgressOpt, SetOpt
from memcli.tools.replay import CHECK_LEVELS
from memcli.workload import FORMATS

NAME = "replay"
# `--check` alone is `--check incremental`; `--check full` names the level (`memcli.cli.options`).
OPTIONAL_VALUES = {"--check": CHECK_LEVELS}


# The study options (`memcli.tools.study.run.StudyOptions`).
SweepOpt: List[str] = typer.Option(
    [], "--sweep", metavar="KEY=V1,V2,...",
    help="A study: one replay per value of a config key (repeat it: every combination of the keys)")
SweepFileOpt: Optional[Path] = typer.Option(
    None, "--sweep-file", metavar="FILE",
    help="A study of the points in a YAML list (each a mapping of config overrides)")
JobsOpt: Optional[int] = typer.Option(
    None, "--jobs", "-j", metavar="N",
    help="Points run at once in local processes (default: the core count; 1: one after another)")
RayOpt: bool = typer.Option(False, "--ray", help="Run each point as a Ray task (pip install 'memcli\\[ray]')")
RayAddressOpt: Optional[str] = typer.Option(
    None, "--ray-address", metavar="ADDR",
    help="Ray cluster to join with --ray (default: RAY_ADDRESS, else a local runtime)")
OutOpt: Optional[Path] = typer.Option(
    None, "--out", metavar="DIR", help="Folder for a study's study.json and study.csv, written as points finish")
ResumeOpt: bool = typer.Option(False, "--resume", help="With --out: skip the points already in DIR/study.json")
StrictLimitsOpt: bool = typer.Option(
    False, "--strict-limits",
    help="Refuse a trace with a request past the engine's limits (exit 2) instead of aborting or clipping it"
    " as the engine does")
PlainLoopOpt: bool = typer.Option(
    False, "--plain-loop",
    help="Take every step as one loop iteration, never a run of steady decode steps at once: the same documents,"
    " slower (to check the fast path, or to time it against)")


def replay_command(
    trace_path: Path = typer.Argument(..., metavar="TRACE", help="Trace file: memcli or Mooncake JSONL"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", metavar="FILE",
                                          help="YAML config (default: the built-in replay config)"),
    set_: List[str] = SetOpt,
    engine: Optional[str] = EngineOpt,
    trace_format: str = typer.Option("auto", "--format", metavar="FORMAT",
                                     help=f"Trace format: {', '.join(FORMATS)}"),
    block_size: int = typer.Option(512, "--block-size", help="Tokens per hash block (Mooncake 512, Qwen-Bailian 16)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="Replay only the first N requests"),
    arrivals: Optional[str] = typer.Option(
        None, "--arrivals", metavar="MODE",
        help="timestamp (trace times on the simulated clock; default when the trace has times),"
        " burst (all at t=0; default otherwise) or sequential (one request at a time)"),
    check: Optional[str] = typer.Option(
        None, "--check", metavar="[incremental|full]",
        help="Check integrity after every step, incrementally (what the step changed, plus sampled"
        " full walks on idle steps; a decode run taken at once is checked after it, for every step it"
        " took); `--check full`: the full walk of the pool after every step (slow on large pools)"),
    sweep: List[str] = SweepOpt,
    sweep_file: Optional[Path] = SweepFileOpt,
    jobs: Optional[int] = JobsOpt,
    use_ray: bool = RayOpt,
    ray_address: Optional[str] = RayAddressOpt,
    out: Optional[Path] = OutOpt,
    resume: bool = ResumeOpt,
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
    steps_out: Optional[Path] = typer.Option(
        None, "--steps-out", metavar="FILE.jsonl",
        help="Write the step log: one JSON object per scheduler step (docs/JSON.md; compare two with memcli diff)"),
    timeline: Optional[Path] = typer.Option(
        None, "--timeline", metavar="FILE.json",
        help="Write a timeline of steps, pool occupancy, requests and evictions (Chrome trace events: ui.perfetto.dev)"),
    progress: bool = ProgressOpt,
    strict_limits: bool = StrictLimitsOpt,
    plain_loop: bool = PlainLoopOpt,
) -> None:
    """Replay a trace through the memory stack and the scheduler with continuous batching.

    Reports prefix-cache hits, allocation, eviction, scheduling and the integrity checks;
    --sweep runs a study: one replay per point, in parallel processes or on Ray."""
    from memcli.cli.progress import bars, wanted
    from memcli.tools.replay.run import ConfigSource, Hooks, ReplayRequest, TraceSource
    from memcli.tools.study.run import StudyOptions

    request = ReplayRequest(TraceSource(trace_path, trace_format, block_size, limit),
                            ConfigSource(config, tuple(with_engine(set_, engine))), arrivals=arrivals, check=check, events=events,
                            bound=bound, plot=plot, requests_out=requests_out, steps_out=steps_out, timeline=timeline,
                            strict_limits=strict_limits, plain_loop=plain_loop)
    study = StudyOptions(tuple(sweep), sweep_file, jobs, use_ray, ray_address, out, resume)
    show = wanted(progress)
    with bars(show) as task:
        hooks = Hooks(task if show else None, lambda ignored: note_ignored(ignored, NAME))
        if study.wanted:
            _no_step_files(steps_out, timeline)
            _study(request, study, hooks, json_out)
        else:
            study.check_unused()
            _replay(request, hooks, json_out)


def _no_step_files(steps_out: Optional[Path], timeline: Optional[Path]) -> None:
    from memcli.errors import MemcliError

    if steps_out is not None or timeline is not None:
        flag = "--steps-out" if steps_out is not None else "--timeline"
        raise MemcliError(f"{flag} writes the steps of one replay, and a study runs one replay per point",
                          "replay the point you want to look at without --sweep / --sweep-file")


def _replay(request, hooks, json_out: bool) -> None:
    """One replay, printed; exit 1 when a check failed or it stopped early."""
    from memcli.tools.replay.report import outcome_document, render_outcome
    from memcli.tools.replay.run import run_replay

    outcome = run_replay(request, hooks)
    if outcome.result.limits:
        print(f"warning: {outcome.result.limits.summary()}; the report lists them (--strict-limits refuses"
              " the trace instead)", file=sys.stderr)
    if outcome.requests_out is not None:
        print(f"requests: wrote {outcome.requests_written:,} rows to {outcome.requests_out}", file=sys.stderr)
    _emit(json_out, outcome_document(outcome), lambda console: render_outcome(outcome, console))
    if outcome.plot is not None:
        print(f"plot: wrote {outcome.plot}", file=sys.stderr)
    stop = outcome.result.stop
    if stop is not None:
        if outcome.result.interrupted:
            raise Interrupted(stop.message)
        print(f"error: {stop.message}", file=sys.stderr)
        print("hint: check the sim costs and the pool sizes; the result above covers the replay so far",
              file=sys.stderr)
    if outcome.failed:
        raise typer.Exit(1)


def _study(request, study, hooks, json_out: bool) -> None:
    """A study, printed; exit 1 when a point's check failed or its replay stalled."""
    from memcli.tools.study.report import render_study
    from memcli.tools.study.run import StudyRequest, run_study

    outcome = run_study(StudyRequest(request, study), hooks)
    if outcome.interrupted is not None:
        raise Interrupted(outcome.interrupted)
    cut = [entry for entry in outcome.document["points"] if entry.get("limit_cut_requests")]
    if cut:
        print(f"warning: the engine's limits cut requests at {len(cut)} of {len(outcome.document['points'])} points;"
              " the report names them (--strict-limits refuses the trace instead)", file=sys.stderr)
    _emit(json_out, outcome.document, lambda console: render_study(outcome.document, console))
    if outcome.plot is not None:
        print(f"plot: wrote {outcome.plot}", file=sys.stderr)
    if outcome.failed:
        raise typer.Exit(1)


def _emit(json_out: bool, document: dict, render) -> None:
    from memcli.report.console import print_json, stdout_console

    if json_out:
        print_json(document)
    else:
        render(stdout_console())
