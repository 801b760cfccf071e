"""Progress on stderr for work that can take more than a couple of seconds: shown when stderr
is a terminal or `--progress` is given, silent otherwise (a log file or a pipe gets none).

Two forms: `bars(show)` (rich progress bars, one per task, for counts that advance) and
`lines(show)` (one plain line per milestone, for steps of uneven length).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Optional

Update = Callable[..., None]  # update(completed, total=None, status="")


def wanted(flag: bool) -> bool:
    """Show progress: asked for with --progress, or stderr is a terminal."""
    return flag or sys.stderr.isatty()


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def bars(show: bool) -> Iterator[Callable[[str], Update]]:
    """Yields `task(label)`, which adds one bar and returns its `update(completed, total=None,
    status="")`. Hidden: `task` returns a callable that does nothing."""
    if not show:
        yield lambda label: _ignore
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from memcli.report.console import stderr_console

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[status]}"), console=stderr_console(), transient=False)

    def task(label: str) -> Update:
        task_id = bar.add_task(label, total=None, status="")

        def update(completed: int, total: Optional[int] = None, status: str = "") -> None:
            bar.update(task_id, completed=completed, status=status, **({} if total is None else {"total": total}))

        return update

    with bar:
        yield task


def lines(show: bool) -> Optional[Callable[[str], None]]:
    """`print(message)` to stderr, or None when hidden."""
    if not show:
        return None
    return lambda message: print(message, file=sys.stderr, flush=True)
