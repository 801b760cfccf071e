"""`memcli check-page-size`: does every component agree on the page size, and does a paged
workload keep the paged layout, sharing, free-list and conservation invariants at every step?

Exit 0 when everything is consistent, 1 when a check fails, 2 for bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from memcli.checks.page_size import DEFAULT_STEPS, parse_injections, run_check_page_size
from memcli.checks.page_size_workload import TRACE_DEFAULT_REQUESTS
from memcli.cli import command
from memcli.commands.show_config import ConfigOpt, SetOpt
from memcli.config import load_config
from memcli.errors import MemcliError
from memcli.report.console import print_json, stdout_console
from memcli.report.page_size_report import render

PAGE_SIZE_HINT = "for example --page-size 1 16 64 (or --page-size 1,16,64)"


def parse_page_sizes(values: List[str], extra: List[str]) -> list[int]:
    """`--page-size 1 16 64` arrives as ["1"] plus extra arguments ["16", "64"]; commas work too."""
    if extra and not values:
        raise MemcliError(f"unexpected argument {extra[0]!r}",
                          hint="check-page-size takes options only; " + PAGE_SIZE_HINT)
    sizes = []
    for text in [*values, *extra]:
        for part in str(text).split(","):
            try:
                sizes.append(int(part))
            except ValueError:
                raise MemcliError(f"--page-size {part!r}: not an integer", hint=PAGE_SIZE_HINT) from None
    return sizes


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@command("check-page-size")
def check_page_size(
    config: Optional[Path] = ConfigOpt,
    set_: List[str] = SetOpt,
    inject: List[str] = typer.Option(
        [], "--inject", help="Debugging: give one component another page size, COMPONENT.page_size=N (components:"
        " kv_pool, allocator, tree_cache, scheduler, null_cache); repeatable"),
    page_size: List[str] = typer.Option(
        [], "--page-size", help="Page sizes to check and compare (default: the config's): --page-size 1 16 64"),
    workload: str = typer.Option("default", "--workload",
                                 help="default (the built-in paged workload) or a trace file"),
    steps: int = typer.Option(DEFAULT_STEPS, "--steps", help="Most scheduler steps per run (0: static checks only)"),
    requests: int = typer.Option(TRACE_DEFAULT_REQUESTS, "--requests",
                                 help="Trace requests to replay, from the start of the file"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document"),
    extra: Optional[List[str]] = typer.Argument(None, hidden=True, metavar="PAGE_SIZE", show_default=False),
) -> None:
    """Check that every component agrees on the page size, then run a paged workload and check
    the paged layout, page sharing, free list and conservation after every step."""
    sizes = parse_page_sizes(page_size, extra or [])
    injections = parse_injections(inject)
    cfg = load_config(config, set_)
    result = run_check_page_size(cfg, sizes or None, injections, workload, steps, requests=requests,
                                 progress=None if json_out else _progress)
    if json_out:
        print_json(result.to_dict())
    else:
        render(result, stdout_console())
    raise typer.Exit(result.exit_code)
