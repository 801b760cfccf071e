"""`memcli reference`: SGLang 0.5.5's own code, fetched from PyPI, to check memcli against it."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from memcli.cli.guard import guarded
from memcli.cli.options import EngineOpt, with_engine, JsonOpt, MemcliCommand, MemcliGroup, ReplayConfigOpt, SetOpt

app = typer.Typer(name="reference", cls=MemcliGroup, no_args_is_help=True, add_completion=False,
                  help="Fetch SGLang's own memory-stack code and diff memcli against the engine's own code step by step.")


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


@app.command("diff", cls=MemcliCommand)
@guarded
def diff(
    trace: str = typer.Argument(..., metavar="TRACE", help="Trace file (memcli or Mooncake JSONL)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="Replay only the first N requests"),
    set_: List[str] = SetOpt,
    engine: Optional[str] = EngineOpt,
    arrivals: str = typer.Option("burst", "--arrivals", metavar="burst|timestamp",
                                 help="burst: every request at t = 0; timestamp: at its trace time"),
    config: Optional[Path] = ReplayConfigOpt,
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Compare at most N steps"),
    steps_out: Optional[Path] = typer.Option(None, "--steps-out", metavar="FILE.jsonl",
                                             help="Write memcli's step log (docs/JSON.md; compare with memcli diff)"),
    reference_steps_out: Optional[Path] = typer.Option(
        None, "--reference-steps-out", metavar="FILE.jsonl", help="Write the step log of the engine's own code"),
    json_out: bool = JsonOpt,
) -> None:
    """Run memcli's scheduler and the engine's own loop side by side and print the first divergent step.

    The loop is semantics.event_loop (overlap, SGLang's default, or --set
    semantics.event_loop=normal). Exit 0 when equal, 1 when they diverge or a side raises
    (SGLang's own assertions, memcli's guards: one `failed:` line), 2 on bad input."""
    from memcli.config import load_config
    from memcli.report.console import print_json
    from memcli.tools.reference_diff.report import diff_document, render
    from memcli.tools.reference_diff.run import run_reference_diff

    cfg = load_config(config, with_engine(set_, engine), builtin="replay")
    result = run_reference_diff(cfg, trace, limit, arrivals, max_steps, steps_out, reference_steps_out)
    if json_out:
        print_json(diff_document(result))
    else:
        print(render(result))
    raise typer.Exit(result.exit_code)
