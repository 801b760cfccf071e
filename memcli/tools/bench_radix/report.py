"""Rendering of `memcli bench-radix`."""

from __future__ import annotations

from rich.console import Console

from memcli.report.envelope import envelope
from memcli.report.tables import kv_table
from memcli.tools.bench_radix.results import BenchRadixResult


def bench_radix_document(result: BenchRadixResult) -> dict:
    """The --json document: the envelope (bench-radix reads no config), then the result."""
    return envelope("bench-radix", result.to_dict())


def render(result: BenchRadixResult, console: Console) -> None:
    rows = [
        ("trace", result.trace), ("requests", result.num_requests), ("page size", result.page_size),
        ("capacity (tokens)", result.capacity_tokens), ("prompt tokens", result.prompt_tokens),
        ("torch threads", result.torch_threads),
        ("radix time (s, median)", result.radix_s), ("baseline time (s, median)", result.baseline_s),
        ("runs (radix / baseline)", f"{_runs(result.radix_runs_s)} / {_runs(result.baseline_runs_s)}"),
        ("speedup (baseline / radix)", f"{result.speedup:.1f}x"),
        ("matched tokens", result.matched_tokens),
        ("hit rate (matched / prompt tokens, full-prompt match)", f"{result.hit_rate:.1%}"),
        ("evicted tokens (radix / baseline)", f"{result.evicted_tokens:,} / {result.baseline_evicted_tokens:,}"),
        ("requests with different matches", result.mismatched_requests),
    ]
    console.print(kv_table("bench-radix: match + insert + evict", rows))



def _runs(times: tuple[float, ...]) -> str:
    return ", ".join(f"{t:.3f}" for t in times)
