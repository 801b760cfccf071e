"""`memcli replay TRACE`, one replay end to end: the options checked, the config loaded, the
trace read, the replay (and under `--bound belady` the same replay under Belady's offline
eviction), then the per-request file and the plot written.

`run_replay` is the entry. A study (`--sweep`) is `memcli.tools.study.run`, which shares
`check_request` and `prepare` (everything before the first replay); this module knows
nothing of studies.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from memcli.config import Config, ignored_keys, load_config
from memcli.errors import MemcliError
from memcli.tools.replay import ARRIVALS, CHECK_LEVELS
from memcli.tools.replay.bound import bound_config
from memcli.tools.replay.ceiling import shared_prefix_lens
from memcli.tools.replay import plot
from memcli.tools.replay.requests import check_requests_out, write_requests
from memcli.tools.replay.results import ReplayOutcome
from memcli.tools.replay.runner import Progress, ProgressFn, ReplayOptions, check_options, default_arrivals, replay
from memcli.workload.readers import read_trace
from memcli.workload.spec import Trace

COMMAND = "replay"
# task(label) adds one progress bar and returns its update(done, total=None, status="").
TaskFn = Callable[[str], Callable[..., None]]


@dataclass(frozen=True)
class ConfigSource:
    """`--config FILE` (default: the built-in replay config) and the `--set KEY=VALUE`s."""

    path: Optional[Path] = None
    overrides: tuple[str, ...] = ()

    def load(self, extra: Sequence[str] = ()) -> Config:
        """The config, with `extra` overrides applied after the `--set`s (a study's point)."""
        return load_config(self.path, [*self.overrides, *extra], builtin="replay")


@dataclass(frozen=True)
class TraceSource:
    """The trace file and how to read it (`--format`, `--block-size`, `--limit`)."""

    path: Path
    format: str = "auto"
    block_size: int = 512
    limit: Optional[int] = None


@dataclass(frozen=True)
class ReplayRequest:
    """What `memcli replay TRACE` was asked. `arrivals` None: the trace's default; `check`
    None (no per-step check), "incremental" or "full"; `bound` None or "belady"; `events`,
    `plot`, `requests_out`, `steps_out` (the step log) and `timeline` are files to write
    (None: none); `strict_limits`: refuse a trace with a request past the engine's limits
    instead of cutting it as the engine does; `plain_loop`: no decode run taken at once."""

    trace: TraceSource
    config: ConfigSource = ConfigSource()
    arrivals: Optional[str] = None
    check: Optional[str] = None
    events: Optional[Path] = None
    bound: Optional[str] = None
    plot: Optional[Path] = None
    requests_out: Optional[Path] = None
    steps_out: Optional[Path] = None
    timeline: Optional[Path] = None
    strict_limits: bool = False  # refuse a request past the engine's limits (exit 2) instead of cutting it
    plain_loop: bool = False  # every step one loop iteration (no decode run taken at once)


def _no_notes(ignored: dict[str, str]) -> None:
    return None


class Hooks(NamedTuple):
    """How a run reports while it runs: `task` adds a progress bar (None: no progress);
    `ignored` receives the config keys the replay does not read ({key: why}), once the
    config is loaded and before anything runs."""

    task: Optional[TaskFn] = None
    ignored: Callable[[dict[str, str]], None] = _no_notes


@dataclass(frozen=True)
class Prepared:
    """Everything before the first replay: the config, its ignored keys, the trace, the
    replay options checked against both, and the trace's shared-prefix lengths (the ceiling)."""

    config: Config
    ignored: dict[str, str]
    trace: Trace
    options: ReplayOptions
    shared: np.ndarray


def check_request(request: ReplayRequest) -> None:
    """Raise `MemcliError` for options that are bad whatever the trace and config."""
    if request.arrivals is not None and request.arrivals not in ARRIVALS:
        raise MemcliError(f'unknown --arrivals "{request.arrivals}"', f"use one of: {', '.join(ARRIVALS)}")
    if request.check is not None and request.check not in CHECK_LEVELS:
        raise MemcliError(f'--check {request.check}: unknown level',
                          "--check alone checks every step incrementally; --check full walks the whole pool")
    if request.plot is not None:
        plot.check_plot_path(request.plot)
        plot.require_matplotlib()
    if request.bound is not None and request.bound != "belady":
        raise MemcliError(f'unknown --bound "{request.bound}"', "the one bound is belady: --bound belady")
    if request.requests_out is not None:
        check_requests_out(request.requests_out)


def prepare(request: ReplayRequest, hooks: Hooks = Hooks()) -> Prepared:
    """Load the config (its ignored keys to `hooks.ignored`), read the trace, check the
    options against both. Raises `MemcliError` for bad input."""
    config = request.config.load()
    ignored = ignored_keys(config, COMMAND)
    hooks.ignored(ignored)
    source = request.trace
    reading = _reading(hooks.task("reading the trace")) if hooks.task is not None else None
    trace = read_trace(source.path, format=source.format, block_size=source.block_size, limit=source.limit,
                       progress=reading)
    options = ReplayOptions(request.arrivals or default_arrivals(trace), request.check is not None, request.events,
                            check_level=request.check or "incremental", steps_path=request.steps_out,
                            timeline_path=request.timeline, strict_limits=request.strict_limits,
                            plain_loop=request.plain_loop)
    check_options(trace, config, options)
    return Prepared(config, ignored, trace, options, shared_prefix_lens(trace))


def run_replay(request: ReplayRequest, hooks: Hooks = Hooks()) -> ReplayOutcome:
    """One replay of the request's trace, with its bound, per-request file and plot. A replay
    that stopped early (Ctrl-C, a stall, an integrity failure) is returned, not raised:
    `outcome.result.stop` says why; no bound or plot is made for a stopped replay."""
    check_request(request)
    p = prepare(request, hooks)
    belady = bound_config(p.config) if request.bound is not None else None
    result = replay(p.config, p.trace, p.options, _replaying(hooks, "replay"), p.shared)
    written = None
    if request.requests_out is not None:
        written = write_requests(request.requests_out, result.requests_log, p.trace)
    bound = None
    if belady is not None and result.stop is None:
        bound = result if belady is p.config else replay(
            belady, p.trace, ReplayOptions(p.options.arrivals), _replaying(hooks, "belady bound"), p.shared)
    plotted = None
    if request.plot is not None and result.stop is None:
        plot.plot_replay(result, request.plot)
        plotted = request.plot
    return ReplayOutcome(result, bound, tuple(sorted(p.ignored)), request.requests_out, written, plotted)


def _reading(update):
    """Progress of reading a trace, in MB of the file as stored."""
    def report(done: int, size, requests: int) -> None:
        update(-(-done >> 20), None if size is None else max(-(-size >> 20), 1), f"MB, {requests:,} requests")
    return report


def _replaying(hooks: Hooks, label: str) -> Optional[ProgressFn]:
    """Progress of one replay: requests finished, the simulated clock and the steps."""
    if hooks.task is None:
        return None
    update = hooks.task(label)

    def report(p: Progress) -> None:
        update(p.finished, p.total, f"sim {p.simulated_ms / 1e3:,.0f} s, {p.steps:,} steps")
    return report
