"""The summary of a written synthetic trace, as a JSON document or a table."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from memcli.report.envelope import envelope
from memcli.report.tables import kv_table
from memcli.tools.gen_trace.results import GenTraceResult


def gen_trace_document(result: GenTraceResult) -> dict[str, Any]:
    """The --json document: the envelope (gen-trace reads no config), then the trace."""
    return envelope("gen-trace", {"path": str(result.out), "bytes": result.num_bytes, "unchanged": result.unchanged,
                                  "params": result.params, "summary": result.stats})


def render(result: GenTraceResult, console: Console) -> None:
    rows = [("path", str(result.out)), ("bytes", result.num_bytes), *result.stats.items()]
    title = "gen-trace: trace already there" if result.unchanged else "gen-trace: wrote a memcli trace"
    console.print(kv_table(title, rows))
    console.print("reusable_input_tokens: input tokens that start like an earlier request's input (unlimited cache).")
