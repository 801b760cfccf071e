"""`memcli gen-trace`: write a synthetic memcli trace and summarise what it holds."""

from __future__ import annotations

from pathlib import Path

import typer

from memcli.cli import command
from memcli.errors import MemcliError
from memcli.report.console import print_json, stdout_console
from memcli.report.tables import kv_table
from memcli.workload.generate import generate_trace, summarize_records, write_trace


@command("gen-trace")
def gen_trace(
    out: Path = typer.Argument(..., help="JSONL file to write (memcli format)"),
    requests: int = typer.Option(200, "--requests", "-n", help="Requests to write"),
    seed: int = typer.Option(0, "--seed", help="Random seed; the same seed writes the same file"),
    system_prompts: int = typer.Option(4, "--system-prompts", help="Distinct system prompts shared by the chats"),
    system_prompt_len: int = typer.Option(1024, "--system-prompt-len", help="Tokens in each system prompt"),
    turns: int = typer.Option(3, "--turns", help="Turns per chat; each turn extends the previous one"),
    input_len: int = typer.Option(256, "--input-len", help="Mean tokens of a new user message"),
    output_len: int = typer.Option(128, "--output-len", help="Mean output tokens of a request"),
    rate: float = typer.Option(4.0, "--rate", help="Poisson arrivals per second; 0 writes no arrival times"),
    force: bool = typer.Option(False, "--force", help="Overwrite OUT if it exists"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document"),
) -> None:
    """Write a trace with shared system prompts, multi-turn chats and Poisson arrivals."""
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
    records = generate_trace(requests, **params)
    num_bytes = write_trace(records, out, overwrite=force)
    summary = summarize_records(records)
    stats = {
        "num_requests": summary.num_requests,
        "input_tokens": summary.input_tokens,
        "output_tokens": summary.output_tokens,
        "mean_input_len": round(summary.mean_input_len, 1),
        "mean_output_len": round(summary.mean_output_len, 1),
        "max_input_len": summary.max_input_len,
        "duration_ms": summary.duration_ms,
        "reusable_input_tokens": summary.reusable_input_tokens,
        "reusable_fraction": round(summary.reusable_fraction, 4),
    }
    if json_out:
        print_json({"path": str(out), "bytes": num_bytes, "params": params, "summary": stats})
        return
    console = stdout_console()
    rows = [("path", str(out)), ("bytes", num_bytes), *stats.items()]
    console.print(kv_table("gen-trace: wrote a memcli trace", rows))
    console.print("reusable_input_tokens: input tokens that start like an earlier request's input (unlimited cache).")
