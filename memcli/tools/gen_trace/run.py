"""`gen-trace` as a function: generate a synthetic trace, write it (unless the file already
holds exactly this trace), and summarise what it holds."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from memcli.errors import MemcliError
from memcli.tools.gen_trace.results import GenTraceResult
from memcli.workload import DEFAULT_MAX_TOKENS
from memcli.workload.generate import check_trace_size, generate_trace, holds_trace, summarize_records, write_trace

# task(label) adds one progress bar and returns its update(done, total=None, status="").
TaskFn = Callable[[str], Callable[..., None]]


@dataclass(frozen=True)
class TraceParams:
    """The generator's options; the same ones (and seed) write the same file."""

    seed: int = 0
    system_prompts: int = 4
    system_prompt_len: int = 1024
    turns: int = 3
    input_len: int = 256
    output_len: int = 128
    rate: float = 4.0


@dataclass(frozen=True)
class GenTraceRequest:
    """What `memcli gen-trace PATH` was asked: `requests` requests into `out`; `force`
    overwrites a file that holds another trace; `max_tokens` refuses larger traces."""

    out: Path
    requests: int = 200
    params: TraceParams = TraceParams()
    force: bool = False
    max_tokens: int = DEFAULT_MAX_TOKENS


def run_gen_trace(request: GenTraceRequest, task: Optional[TaskFn] = None) -> GenTraceResult:
    """Generate, write (or find already there) and summarise the trace. Raises `MemcliError`
    for bad input (a folder, a trace too large, a file holding another trace without `force`)."""
    out, n, params = request.out, request.requests, asdict(request.params)
    if out.is_dir():
        raise MemcliError(f"{out} is a folder", "give the path of the file to write, e.g. chat.jsonl")
    check_trace_size(request.max_tokens, n, **{k: v for k, v in params.items() if k not in ("seed", "rate")})
    task = task or _hidden
    records = generate_trace(n, **params, progress=_counting(task("generating"), n))
    unchanged = out.exists() and not request.force and holds_trace(records, out)
    if out.exists() and not request.force and not unchanged:
        raise MemcliError(f"{out} already exists and holds another trace",
                          "pass --force to overwrite it, or choose another path")
    if unchanged:
        num_bytes = out.stat().st_size
    else:
        num_bytes = write_trace(records, out, overwrite=request.force, progress=_counting(task("writing"), n))
    stats = trace_stats(records, progress=_counting(task("summarizing"), n))
    return GenTraceResult(out, num_bytes, params, stats, unchanged)


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


def _hidden(label: str) -> Callable[..., None]:
    return lambda *args, **kwargs: None


def _counting(update, total: int):
    """A progress callback for `total` requests: the bar, and its end when the work ends."""
    update(0, total)
    return lambda done: update(done, total)
