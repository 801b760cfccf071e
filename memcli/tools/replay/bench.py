"""`python -m memcli.tools.replay.bench [TRACE]`: how fast replays run, in requests/s and steps/s.

The trace is read once; each point (a set of `--set` overrides on the built-in replay config)
is replayed `--rounds` times, the points interleaved within each round so that a burst of
host noise falls on every point alike. A point's figure is the median of its rounds' replay
times (`summary.wall_s`: stack build, every step, the final integrity check; not the trace
read). Each round also replays the point through the plain loop (every step one loop
iteration, `memcli replay --plain-loop`) right after the fast path, and the table gives the
ratio of the two medians (`--no-plain` skips them); with `--check`, each round also replays the
point under the incremental integrity check every step (`memcli replay --check`, the fast path),
and the table gives its median over the unchecked one. Each round also times the floor of the
trace's array work (`memcli.tools.replay.floor`: the bulk copies a replay makes, and nothing
else; `--no-floor` skips it), printed below the table with each point's replay time over it.
Every replay of a point must give the
same steps, hits, clock and evictions, or the bench stops: a replay's document depends
neither on its speed nor on the path. The machine (CPU count, model name) and its load
average before and after are printed with the figures, since on a shared host they say how
far the figures can be trusted. Below the table: where each point's time goes, by kind of
step (`memcli.tools.replay.step_times`).

Default points: page sizes 1 and 16 of the radix cache, and page size 1 of the host tier
(hiradix), each with `--engine` (default sglang-0.5.23); a default point the engine cannot run
(vLLM 0.33 has no host tier), or reads as the config of a point before it (vLLM 0.33 takes page
size 1 as its block size 16), is left out and named on stderr. `--point "k=v k=v"` replaces
them (and a point the engine cannot run is bad input).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, NamedTuple, Optional, Sequence

from memcli import engines
from memcli.config import load_config
from memcli.errors import MemcliError
from memcli.tools.replay.ceiling import shared_prefix_lens
from memcli.tools.replay.floor import DEFAULT_TRACE, array_work
from memcli.tools.replay.runner import ReplayOptions, check_options, default_arrivals, replay
from memcli.tools.replay.step_times import StepTimes
from memcli.workload.readers import read_trace

DEFAULT_POINTS = ("memory.page_size=1", "memory.page_size=16", "memory.page_size=1 cache.kind=hiradix")


def default_points(engine: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The default points `engine` runs, and (point, why) for those its config refuses or
    reads as an earlier point's config (vLLM 0.33 reads page size 1 as its block size 16)."""
    points, skipped, configs = [], [], []
    for point in DEFAULT_POINTS:
        try:
            config = load_config(None, [*point.split(), f"semantics.engine={engine}"], builtin="replay")
            check = engines.get(config).check
            if check is not None:
                check(config)
        except MemcliError as exc:
            skipped.append((point, exc.message))
            continue
        same = next((earlier for earlier, other in zip(points, configs) if other == config), None)
        if same is not None:
            skipped.append((point, f"{engine} reads it as the same config as {same!r}"))
            continue
        points.append(point)
        configs.append(config)
    return points, skipped


@dataclass(frozen=True)
class BenchPoint:
    """One point's figures: the median replay time over its rounds, and the rates from it;
    the same for the plain loop (every step one iteration, no decode run taken at once)."""

    point: str
    requests: int
    steps: int
    cached_tokens: int
    replay_s: float  # median of the rounds
    rounds_s: tuple[float, ...]
    requests_per_s: float
    steps_per_s: float
    step_times: dict  # the median round's wall time by kind of step (`StepTimes.to_dict`)
    plain_s: Optional[float] = None  # median of the plain loop's rounds
    plain_rounds_s: tuple[float, ...] = ()
    checked_s: Optional[float] = None  # median of the rounds under `--check` (incremental, every step)
    checked_rounds_s: tuple[float, ...] = ()
    floor_s: Optional[float] = None  # median of the rounds' array work alone (the trace's, the same for every point)
    floor_rounds_s: tuple[float, ...] = ()

    @property
    def speedup(self) -> Optional[float]:
        """Plain loop time over fast path time, medians of the same rounds."""
        return None if self.plain_s is None else self.plain_s / self.replay_s

    @property
    def check_cost(self) -> Optional[float]:
        """Checked time over unchecked time (both the fast path), medians of the same rounds."""
        return None if self.checked_s is None else self.checked_s / self.replay_s

    @property
    def over_floor(self) -> Optional[float]:
        """Replay time over the floor of its array work, medians of the same rounds."""
        return None if self.floor_s is None else self.replay_s / self.floor_s


def machine() -> dict:
    """What the figures were measured on: CPU count and model, and the load average now."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": model, "load_avg_1m": round(os.getloadavg()[0], 2)}


def run_bench(trace_path: Path, points: Sequence[str], engine: str, limit: Optional[int] = None,
              rounds: int = 1, plain: bool = True, check: bool = False, floor: bool = True) -> list[BenchPoint]:
    """Replay every point `rounds` times (interleaved; with `plain`, each time also through
    the plain loop; with `check`, also under the incremental check every step; with `floor`,
    each round also times the trace's array work alone, `floor.array_work`); raises
    `MemcliError` for bad input or when two replays of one point disagree on the steps, the
    hits, the clock or the evictions, or a checked replay finds a failure."""
    trace = read_trace(trace_path, limit=limit)
    shared = shared_prefix_lens(trace)
    configs = [load_config(None, [*point.split(), f"semantics.engine={engine}"], builtin="replay") for point in points]
    arrivals = default_arrivals(trace)
    modes = {"fast": ReplayOptions(arrivals, step_times=True)}
    if plain:
        modes["plain"] = ReplayOptions(arrivals, step_times=True, plain_loop=True)
    if check:
        modes["checked"] = ReplayOptions(arrivals, check_every_step=True, step_times=True)
    for config in configs:
        check_options(trace, config, modes["fast"])
    runs: list[dict[str, list[_Round]]] = [{mode: [] for mode in modes} for _ in points]
    floors: list[float] = []
    for _ in range(rounds):
        for i, config in enumerate(configs):
            for mode, options in modes.items():
                runs[i][mode].append(_replay_round(points[i], config, trace, options, shared, runs[i].values()))
        if floor:
            floors.append(array_work(trace, shared))
    floor_s = statistics.median(floors) if floors else None
    rows = []
    for point, by_mode in zip(points, runs):
        fast = by_mode["fast"]
        samples = [r.wall_s for r in fast]
        median = statistics.median(samples)
        middle = fast[sorted(range(len(samples)), key=samples.__getitem__)[(len(samples) - 1) // 2]]
        plain_rounds, checked_rounds = (tuple(r.wall_s for r in by_mode.get(m, ())) for m in ("plain", "checked"))
        rows.append(BenchPoint(point, trace.num_requests, middle.outcome[0], middle.outcome[1], median, tuple(samples),
                               trace.num_requests / median, middle.outcome[0] / median, middle.step_times.to_dict(),
                               statistics.median(plain_rounds) if plain_rounds else None, plain_rounds,
                               statistics.median(checked_rounds) if checked_rounds else None, checked_rounds,
                               floor_s, tuple(floors)))
    return rows


class _Round(NamedTuple):
    wall_s: float
    outcome: tuple  # steps, hits, simulated clock, evictions: equal for every replay of a point
    step_times: StepTimes


def _replay_round(point: str, config, trace, options: ReplayOptions, shared, earlier: Iterable) -> _Round:
    result = replay(config, trace, options, None, shared)
    if result.stop is not None or result.integrity.failure is not None:
        raise MemcliError(f"point {point!r}: the replay did not finish cleanly", "run it with memcli replay to see why")
    outcome = (result.summary.steps, int(result.first_cached_tokens.sum()), result.summary.simulated_ms,
               result.eviction.evictions)
    for other in (r for mode in earlier for r in mode):
        if other.outcome != outcome:
            raise MemcliError(f"point {point!r}: two replays differ (steps, cached tokens, clock, evictions)"
                              f" {other.outcome} vs {outcome}", "a replay must not depend on its speed or on the"
                              " fast path: this is a bug in memcli")
    return _Round(result.summary.wall_s, outcome, result.step_times)


def format_table(rows: Sequence[BenchPoint], before: dict, after: dict, engine: str) -> str:
    plain = any(r.plain_s is not None for r in rows)
    checked = any(r.checked_s is not None for r in rows)
    lines = [f"replay speed, engine {engine}: {before['cpus']} CPUs ({before['cpu']}),"
             f" load average {before['load_avg_1m']} before, {after['load_avg_1m']} after",
             f"{'point':<42} {'requests':>9} {'steps':>8} {'replay s':>9} {'requests/s':>11} {'steps/s':>9}"
             + (f" {'plain s':>8} {'speed-up':>8}" if plain else "")
             + (f" {'checked s':>9} {'check x':>7}" if checked else "") + "  rounds (s)"]
    for r in rows:
        line = (f"{r.point:<42} {r.requests:>9,} {r.steps:>8,} {r.replay_s:>9.2f} {r.requests_per_s:>11,.0f}"
                f" {r.steps_per_s:>9,.0f}")
        if plain:
            line += f" {r.plain_s:>8.2f} {r.speedup:>7.2f}x" if r.plain_s is not None else f" {'':>8} {'':>8}"
        if checked:
            line += f" {r.checked_s:>9.2f} {r.check_cost:>6.2f}x" if r.checked_s is not None else f" {'':>9} {'':>7}"
        rounds = " ".join(f"{t:.2f}" for t in r.rounds_s)
        for name, times in (("plain", r.plain_rounds_s), ("checked", r.checked_rounds_s)):
            if times:
                rounds += f" | {name} " + " ".join(f"{t:.2f}" for t in times)
        lines.append(f"{line}  {rounds}")
    if plain:
        lines.append("plain s: the same replay with every step one loop iteration (--plain-loop), its rounds"
                     " interleaved with the fast path's; speed-up = plain s / replay s")
    if checked:
        lines.append("checked s: the same replay under --check (the incremental check after every step), its rounds"
                     " interleaved; check x = checked s / replay s")
    floored = [r for r in rows if r.floor_s is not None]
    if floored:
        first = floored[0]
        lines.append(f"floor: the trace's array work alone (python -m memcli.tools.replay.floor: each request's bulk"
                     f" copies at page size 1, nothing else) {first.floor_s:.3f} s, rounds "
                     + " ".join(f"{t:.3f}" for t in first.floor_rounds_s) + "; replay s over it: "
                     + ", ".join(f"{r.point} {r.over_floor:.1f}x" for r in floored))
    return "\n".join(lines)


def format_step_times(rows: Sequence[BenchPoint]) -> str:
    """Each point's replay time by kind of step (`memcli.tools.replay.step_times`), from
    the round of median time: steps, microseconds per step, share of the replay."""
    lines = ["where the replay time goes (the round of median time; share of replay s)",
             f"{'point':<42} {'kind of step':<17} {'steps':>8} {'us/step':>9} {'share':>6}"]
    for r in rows:
        split, label = r.step_times, r.point
        for kind, k in split["kinds"].items():
            if k["steps"]:
                lines.append(f"{label:<42} {kind:<17} {k['steps']:>8,} {k['us_per_step']:>9,.1f}"
                             f" {k['wall_s'] / r.replay_s:>6.1%}")
                label = ""
        outside = r.replay_s - split["loop_wall_s"]
        lines.append(f"{label:<42} {'between steps':<17} {'':>8} {'':>9} {split['between_steps_wall_s'] / r.replay_s:>6.1%}")
        lines.append(f"{'':<42} {'outside the loop':<17} {'':>8} {'':>9} {outside / r.replay_s:>6.1%}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memcli.tools.replay.bench", description=__doc__.split("\n")[0])
    parser.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--engine", default="sglang-0.5.23")
    parser.add_argument("--point", action="append", help='overrides of one point, e.g. "memory.page_size=16"')
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-plain", action="store_true", help="skip the plain-loop replays (and the speed-up)")
    parser.add_argument("--check", action="store_true", help="also replay under --check (its cost over unchecked)")
    parser.add_argument("--no-floor", action="store_true", help="skip timing the array work alone (the floor)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        print("error: --rounds must be at least 1\nhint: --rounds 3 takes the median of three", file=sys.stderr)
        return 2
    before = machine()
    points, skipped = (args.point, []) if args.point else default_points(args.engine)
    for point, why in skipped:
        print(f"note: default point {point!r} left out: {why}", file=sys.stderr)
    try:
        if not points:
            raise MemcliError(f"{args.engine} runs none of the default points", 'give points with --point "k=v k=v"')
        rows = run_bench(args.trace, points, args.engine, args.limit, args.rounds,
                         plain=not args.no_plain, check=args.check, floor=not args.no_floor)
    except MemcliError as exc:
        print(exc.lines(), file=sys.stderr)
        return exc.exit_code
    after = machine()
    if args.json:
        print(json.dumps({"engine": args.engine, "machine": before, "load_avg_1m_after": after["load_avg_1m"],
                          "left_out": [{"point": point, "why": why} for point, why in skipped],
                          "points": [{**asdict(r), "speedup": r.speedup, "check_cost": r.check_cost,
                                      "over_floor": r.over_floor} for r in rows]},
                         indent=1))
    else:
        print(format_table(rows, before, after, args.engine))
        print()
        print(format_step_times(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
