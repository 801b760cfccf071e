"""`memcli diff`: two step logs, or one trace under two sets of options, compared step by step."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from memcli.cli.options import JsonOpt


def diff_command(
    a: Path = typer.Argument(..., metavar="A", help="A step log (replay --steps-out), or the trace with --a / --b"),
    b: Optional[Path] = typer.Argument(None, metavar="B", help="The step log to compare A with"),
    a_args: Optional[str] = typer.Option(None, "--a", metavar="OPTIONS",
                                         help='Replay TRACE with these options as side A: "--set k=v --engine NAME'
                                         ' --config FILE"'),
    b_args: Optional[str] = typer.Option(None, "--b", metavar="OPTIONS", help="The same for side B"),
    limit: Optional[int] = typer.Option(None, "--limit", help="With --a / --b: replay only the first N requests"),
    arrivals: Optional[str] = typer.Option(None, "--arrivals", metavar="MODE",
                                           help="With --a / --b: timestamp, burst or sequential (as replay)"),
    context: int = typer.Option(3, "--context", metavar="N", help="Steps shown before and after the first divergence"),
    json_out: bool = JsonOpt,
) -> None:
    """Compare two runs step by step: two step logs, or one trace under two sets of options.

    Prints the first divergent step with the steps around it, what differs there (requests,
    cached tokens, evictions, sizes), and every request whose cached tokens differ over the
    whole run. Exit 0 when equal, 1 when they differ, 2 on bad input."""
    from memcli.report.console import print_json
    from memcli.tools.diff.report import diff_document, render
    from memcli.tools.diff.run import DiffRequest, run_diff

    result = run_diff(DiffRequest(a, b, a_args, b_args, limit, arrivals, context))
    if json_out:
        print_json(diff_document(result))
    else:
        print(render(result))
    raise typer.Exit(result.exit_code)
