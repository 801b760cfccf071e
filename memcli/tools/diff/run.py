"""`memcli diff`: two step logs compared (`memcli diff A.jsonl B.jsonl`), or one trace replayed
under two sets of options and their logs compared (`memcli diff TRACE --a "--set k=v" --b
"--set k=v"`). Each side's options are `--set KEY=VALUE`, `--engine NAME` and `--config FILE`;
`--limit` and `--arrivals` apply to both."""

from __future__ import annotations

import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from memcli.errors import MemcliError
from memcli.tools.diff.compare import compare_logs
from memcli.tools.diff.results import DiffResult
from memcli.tools.replay.steplog import read_log

SIDE_FLAGS = ("--set", "-s", "--engine", "--config", "-c")


@dataclass(frozen=True)
class DiffRequest:
    """`a`, `b`: two step logs; or `a` a trace and `b` None, with `a_args` / `b_args` the
    options of each side's replay. `context`: steps shown before and after the first divergence."""

    a: Path
    b: Optional[Path] = None
    a_args: Optional[str] = None
    b_args: Optional[str] = None
    limit: Optional[int] = None
    arrivals: Optional[str] = None
    context: int = 3

    @property
    def replays(self) -> bool:
        return self.a_args is not None or self.b_args is not None


def run_diff(request: DiffRequest) -> DiffResult:
    """Compare; raises `MemcliError` (exit 2) for bad input: a malformed log line, options
    that do not apply, a trace or config the replay refuses."""
    if request.context < 0:
        raise MemcliError(f"--context {request.context}: must be 0 or more", "--context 3 shows 3 steps each side")
    if not request.replays:
        if request.b is None:
            raise MemcliError("memcli diff needs two step logs, or a trace and the options of each side",
                              'memcli diff A.jsonl B.jsonl, or memcli diff TRACE --a "--set k=v" --b "--set k=v"')
        if request.limit is not None or request.arrivals is not None:
            raise MemcliError("--limit and --arrivals apply to a trace replayed twice, not to two step logs",
                              'memcli diff TRACE --a "..." --b "..." --limit N')
        diff = compare_logs(read_log(request.a), read_log(request.b), request.context)
        return DiffResult(str(request.a), str(request.b), diff)
    if request.b is not None:
        raise MemcliError(f"with --a / --b, {request.a} is the trace and {request.b} is one file too many",
                          'memcli diff TRACE --a "--set k=v" --b "--set k=v"')
    return _replay_twice(request)


def side_options(text: Optional[str], which: str) -> tuple[Optional[Path], tuple[str, ...]]:
    """The `--config` and the `--set` overrides (with `--engine` as `semantics.engine`) of one side."""
    try:
        words = shlex.split(text or "")
    except ValueError as exc:
        raise MemcliError(f"--{which} {text!r}: {exc}", "quote each side's options as one argument") from None
    config, overrides = None, []
    it = iter(words)
    for word in it:
        flag, eq, value = word.partition("=") if word.startswith("--") else (word, "", "")
        if flag not in SIDE_FLAGS:
            raise MemcliError(f"--{which}: unknown option {word!r}", f"each side takes {', '.join(SIDE_FLAGS)}")
        if not eq:
            value = next(it, None)
            if value is None:
                raise MemcliError(f"--{which}: {flag} needs a value", f'--{which} "{flag} VALUE"')
        if flag in ("--config", "-c"):
            config = Path(value)
        else:
            overrides.append(value if flag in ("--set", "-s") else f"semantics.engine={value}")
    return config, tuple(overrides)


def _replay_twice(request: DiffRequest) -> DiffResult:
    from memcli.tools.replay.run import ConfigSource, ReplayRequest, TraceSource, run_replay

    sides = [side_options(request.a_args, "a"), side_options(request.b_args, "b")]
    notes = []
    with tempfile.TemporaryDirectory(prefix="memcli-diff-") as folder:
        paths = [Path(folder) / "a.jsonl", Path(folder) / "b.jsonl"]
        for name, (config, overrides), path in zip("AB", sides, paths):
            outcome = run_replay(ReplayRequest(TraceSource(request.a, limit=request.limit),
                                               ConfigSource(config, overrides), arrivals=request.arrivals,
                                               steps_out=path))
            result = outcome.result
            if result.stop is not None:
                notes.append(f"{name}'s replay stopped early: {result.stop.message}")
            if result.integrity.failure is not None:
                notes.append(f"{name}'s replay failed a check: {result.integrity.failure}")
        diff = compare_logs(read_log(paths[0]), read_log(paths[1]), request.context)
    label = f"{request.a}" + (f" (--limit {request.limit})" if request.limit is not None else "")
    return DiffResult(f"{label} with {request.a_args or '(defaults)'}", f"{label} with {request.b_args or '(defaults)'}",
                      diff, tuple(notes))
