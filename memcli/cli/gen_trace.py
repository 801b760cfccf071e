"""`memcli gen-trace`: write a synthetic memcli trace and summarise what it holds."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from memcli.cli.options import JsonOpt, ProgressOpt
from memcli.workload import DEFAULT_MAX_TOKENS


def gen_trace(
    out: Path = typer.Argument(..., metavar="PATH", help="JSONL file to write (memcli format)"),
    requests: int = typer.Option(200, "--requests", "-n", help="Requests to write"),
    seed: int = typer.Option(0, "--seed", help="Random seed; the same seed writes the same file"),
    system_prompts: int = typer.Option(4, "--system-prompts", help="Distinct system prompts shared by the chats"),
    system_prompt_len: int = typer.Option(1024, "--system-prompt-len", help="Tokens in each system prompt"),
    turns: int = typer.Option(3, "--turns", help="Turns per chat; each turn extends the previous one"),
    input_len: int = typer.Option(256, "--input-len", help="Mean tokens of a new user message"),
    output_len: int = typer.Option(128, "--output-len", help="Mean output tokens of a request"),
    rate: float = typer.Option(4.0, "--rate", help="Poisson arrivals per second; 0 writes no arrival times"),
    force: bool = typer.Option(False, "--force", help="Overwrite PATH if it holds another trace"),
    max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens",
                                   help="Refuse traces expected to hold more tokens than this"),
    json_out: bool = JsonOpt,
    progress: bool = ProgressOpt,
) -> None:
    """Write a synthetic trace with shared system prompts, multi-turn chats and Poisson arrivals.

    The same options write the same file: when PATH already holds exactly this trace it is
    left as it is (a note says so); when it holds anything else, --force overwrites it."""
    from memcli.cli.progress import bars, wanted
    from memcli.report.console import print_json, stdout_console
    from memcli.tools.gen_trace.report import gen_trace_document, render
    from memcli.tools.gen_trace.run import GenTraceRequest, TraceParams, run_gen_trace

    params = TraceParams(seed, system_prompts, system_prompt_len, turns, input_len, output_len, rate)
    request = GenTraceRequest(out, requests, params, force, max_tokens)
    show = wanted(progress)
    with bars(show) as task:
        result = run_gen_trace(request, task if show else None)
    if result.unchanged:
        print(f"note: {out} already holds this trace (same options and seed): left as it is", file=sys.stderr)
    if json_out:
        print_json(gen_trace_document(result))
        return
    render(result, stdout_console())
