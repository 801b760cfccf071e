"""The summary of a written synthetic trace, as a JSON document or a table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from memcli.report.envelope import envelope
from memcli.report.tables import kv_table
from memcli.workload.generate import summarize_records


def trace_stats(records: list, progress=None) -> dict[str, Any]:
    """What the written trace holds: request and token counts, and its reusable share."""
    summary = summarize_records(records, progress)
    return {
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


def gen_trace_document(out: Path, num_bytes: int, params: dict, stats: dict, unchanged: bool = False) -> dict[str, Any]:
    """The --json document: the envelope (gen-trace reads no config), then the trace. `unchanged`:
    the file already held this very trace and was not written again."""
    return envelope("gen-trace", {"path": str(out), "bytes": num_bytes, "unchanged": unchanged, "params": params,
                                  "summary": stats})


def render(out: Path, num_bytes: int, stats: dict, console: Console, unchanged: bool = False) -> None:
    rows = [("path", str(out)), ("bytes", num_bytes), *stats.items()]
    title = "gen-trace: trace already there" if unchanged else "gen-trace: wrote a memcli trace"
    console.print(kv_table(title, rows))
    console.print("reusable_input_tokens: input tokens that start like an earlier request's input (unlimited cache).")
