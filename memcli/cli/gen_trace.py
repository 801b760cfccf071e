"""`memcli gen-trace`: write a synthetic memcli trace and summarise what it holds."""

from __future__ import annotations

from pathlib import Path

import typer

from memcli.cli.options import JsonOpt
from memcli.errors import MemcliError
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
    force: bool = typer.Option(False, "--force", help="Overwrite PATH if it exists"),
    max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens",
                                   help="Refuse traces expected to hold more tokens than this"),
    json_out: bool = JsonOpt,
) -> None:
    """Write a synthetic trace with shared system prompts, multi-turn chats and Poisson arrivals."""
    from memcli.report.console import print_json, stdout_console
    from memcli.tools.gen_trace.report import gen_trace_document, render, trace_stats
    from memcli.workload.generate import check_trace_size, generate_trace, write_trace

    if out.exists() and not force:
        raise MemcliError(f"{out} already exists", "pass --force to overwrite it, or choose another path")
    params = {
        "seed": seed,
        "system_prompts": system_prompts,
        "system_prompt_len": system_prompt_len,
        "turns": turns,
        "input_len": input_len,
        "output_len": output_len,
        "rate": rate,
    }
    check_trace_size(max_tokens, requests, system_prompts=system_prompts, system_prompt_len=system_prompt_len,
                     turns=turns, input_len=input_len, output_len=output_len)
    records = generate_trace(requests, **params)
    num_bytes = write_trace(records, out, overwrite=force)
    stats = trace_stats(records)
    if json_out:
        print_json(gen_trace_document(out, num_bytes, params, stats))
        return
    render(out, num_bytes, stats, stdout_console())
