"""`memcli bench-radix`: time the radix cache against a token-by-token baseline tree."""

from __future__ import annotations

from pathlib import Path

import typer

from memcli.cli.options import JsonOpt, ProgressOpt
from memcli.errors import MemcliError
from memcli.tools.bench_radix import DEFAULT_CAPACITY_TOKENS


def bench_radix(
    trace: Path = typer.Option(..., "--trace", metavar="TRACE",
                               help="Mooncake or memcli JSONL trace, e.g. tests/data/conversation_head300.jsonl"),
    requests: int = typer.Option(2000, "--requests", "-n", help="Replay the first N requests"),
    page_size: int = typer.Option(1, "--page-size", help="Page size of both trees (tokens)"),
    capacity: int = typer.Option(DEFAULT_CAPACITY_TOKENS, "--capacity", help="Tokens kept in the tree; evict above"),
    threads: int = typer.Option(1, "--threads", help="torch intra-op threads during the replay (0: keep torch's)"),
    repeat: int = typer.Option(3, "--repeat", help="Replays per implementation; the median is reported"),
    json_out: bool = JsonOpt,
    progress: bool = ProgressOpt,
) -> None:
    """Time match, insert and evict of the radix cache against a token-by-token baseline tree."""
    from memcli.cli.progress import lines, wanted
    from memcli.report.console import print_json, stdout_console
    from memcli.tools.bench_radix.report import bench_radix_document, render
    from memcli.tools.bench_radix.run import run_bench_radix

    if threads < 0:
        raise MemcliError(f"--threads {threads}: must be 0 (keep torch's setting) or more",
                          hint="for example --threads 1")
    say = lines(wanted(progress))
    result = run_bench_radix(trace, requests, page_size, capacity,
                             progress=(lambda name, done, total: say(f"{name}: {done}/{total} requests")) if say else None,
                             torch_threads=threads or None, repeat=repeat)
    if json_out:
        print_json(bench_radix_document(result))
        return
    render(result, stdout_console())
