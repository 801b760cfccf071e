"""`memcli check-page-size`: does every component agree on the page size, and does a paged
workload keep the paged layout, sharing, free-list and conservation invariants at every step?

Exit 0 when everything is consistent, 1 when a check fails or requests did not finish within
--steps (unless --allow-unfinished), 2 for bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from memcli.cli.options import EngineOpt, with_engine, LIST_METAVAR, ConfigOpt, JsonOpt, ProgressOpt, SetOpt, parse_ints
from memcli.tools.check_page_size import DEFAULT_STEPS, TRACE_DEFAULT_REQUESTS

LIST_FLAGS = ("--page-size",)


def check_page_size(
    config: Optional[Path] = ConfigOpt,
    set_: List[str] = SetOpt,
    engine: Optional[str] = EngineOpt,
    inject: List[str] = typer.Option(
        [], "--inject", metavar="COMPONENT.page_size=N",
        help="Debugging: give one component another page size (components: kv_pool, allocator, tree_cache,"
        " scheduler, null_cache); repeatable"),
    page_size: List[str] = typer.Option(
        [], "--page-size", metavar=LIST_METAVAR,
        help="Page sizes to check and compare (default: the config's): --page-size 1 16 64"),
    workload: str = typer.Option("default", "--workload", metavar="default|TRACE",
                                 help="default (the built-in paged workload) or a trace file"),
    steps: int = typer.Option(DEFAULT_STEPS, "--steps", help="Most scheduler steps per run (0: static checks only)"),
    requests: int = typer.Option(TRACE_DEFAULT_REQUESTS, "--requests",
                                 help="Trace requests to replay, from the start of the file"),
    allow_unfinished: bool = typer.Option(
        False, "--allow-unfinished", help="Exit 0 even when requests did not finish within --steps"),
    json_out: bool = JsonOpt,
    progress: bool = ProgressOpt,
) -> None:
    """Check that every component agrees on the page size, and that paged workloads keep the invariants.

    The static checks compare the page size each component holds; the dynamic run replays a
    workload and checks the paged layout, page sharing, free list and conservation after
    every step."""
    from memcli.cli.progress import lines, wanted
    from memcli.config import load_config
    from memcli.report.console import print_json, stdout_console
    from memcli.tools.check_page_size.report import check_document, render, unfinished_hint
    from memcli.tools.check_page_size.run import parse_injections, run_check_page_size

    sizes = parse_ints("--page-size", page_size, None)
    injections = parse_injections(inject)
    cfg = load_config(config, with_engine(set_, engine))
    result = run_check_page_size(cfg, sizes or None, injections, workload, steps, requests=requests,
                                 progress=lines(wanted(progress)), allow_unfinished=allow_unfinished)
    if json_out:
        print_json(check_document(result, cfg))
    else:
        render(result, stdout_console())
    if result.unfinished and not allow_unfinished:
        print(f"hint: {unfinished_hint(result)}", file=sys.stderr)
    raise typer.Exit(result.exit_code)
