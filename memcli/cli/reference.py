"""`memcli reference`: SGLang 0.5.5's own code, fetched from PyPI, to check memcli against it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from memcli.cli.guard import guarded
from memcli.cli.options import JsonOpt, MemcliCommand, MemcliGroup

app = typer.Typer(name="reference", cls=MemcliGroup, no_args_is_help=True, add_completion=False,
                  help="Fetch SGLang 0.5.5's own memory-stack code and diff memcli against it step by step.")


@app.command("fetch", cls=MemcliCommand)
@guarded
def fetch(
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", metavar="PATH", help="Where to keep the wheel"
                                             " (default: $MEMCLI_CACHE_DIR or ~/.cache/memcli)"),
    json_out: bool = JsonOpt,
) -> None:
    """Download the sglang 0.5.5 wheel (once) and unpack the modules memcli is tested against."""
    from memcli.reference.fetch import SGLANG_VERSION, fetch_reference, fetch_wheel
    from memcli.report.console import print_json
    from memcli.report.envelope import envelope

    wheel = fetch_wheel(cache_dir)
    root = fetch_reference(cache_dir)
    if json_out:
        print_json(envelope("reference fetch", {"version": SGLANG_VERSION, "wheel": str(wheel),
                                                "extracted": str(root)}))
    else:
        print(f"sglang {SGLANG_VERSION}: {wheel}\nunpacked: {root}")


@app.command("diff", cls=MemcliCommand, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def diff(ctx: typer.Context,
         trace: str = typer.Argument(..., metavar="TRACE", help="Trace file (memcli or Mooncake JSONL)")) -> None:
    """Run memcli's scheduler and SGLang 0.5.5's loop side by side and print the first divergent step.

    Options: --limit N, --set KEY=VALUE, --arrivals burst|timestamp, --config FILE,
    --max-steps N, --json. The loop is semantics.event_loop (overlap, SGLang's default, or --set
    semantics.event_loop=normal). Exit 0 when equal, 1 when they diverge or a side raises
    (SGLang's own assertions, memcli's guards: one `failed:` line), 2 on bad input."""
    # A process of its own: the Triton interpreter must be chosen before any kernel is
    # imported, and this process may have imported them already (a test run, for one).
    proc = subprocess.run([sys.executable, "-m", "memcli.reference.diff", trace, *ctx.args])
    raise typer.Exit(proc.returncode)
