"""Step-level differential run: memcli's scheduler against SGLang 0.5.5's loop, step by step.

    python -m memcli.reference.diff TRACE --limit N [--set section.key=value ...]
        [--arrivals burst|timestamp] [--config FILE] [--max-steps N] [--json]

The loop compared is `semantics.event_loop` (overlap: SGLang's default `event_loop_overlap`;
`--set semantics.event_loop=normal` for `event_loop_normal`).

Prints the first divergent step with both sides' observations and state, or
"0 divergent steps in S steps" with the run times of both sides, or "failed:" when a side
raised instead of taking its step (SGLang's own assertions and leak check, memcli's
integrity and progress guards) (`--json`: one document, in the envelope of docs/JSON.md).
Exit 0 when equal, 1 when divergent or failed, 2 on bad input (`error:` / `hint:` lines).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Optional

import torch

if not torch.cuda.is_available():
    # Before any kernel module is imported: Triton decides between compiling and
    # interpreting when a kernel is decorated (see memcli.reference.loader).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from memcli.config import load_config  # noqa: E402
from memcli.errors import MemcliError  # noqa: E402
from memcli.reference.loop import ARRIVALS  # noqa: E402
from memcli.reference.observe import StepDiff, run_side_by_side  # noqa: E402
from memcli.report.console import print_json  # noqa: E402
from memcli.report.envelope import envelope  # noqa: E402
from memcli.capacity import check_fits  # noqa: E402
from memcli.workload.readers import read_trace  # noqa: E402
from memcli.workload.spec import output_token_base  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m memcli.reference.diff", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--arrivals", choices=ARRIVALS, default="burst")
    parser.add_argument("--config", default=None, help="YAML config (default: the built-in replay config)")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


def run(argv: Optional[list[str]] = None) -> tuple[StepDiff, str]:
    """Parse, load and run; returns the result and the text to print (one JSON document with
    --json). Raises MemcliError."""
    args = _parser().parse_args(argv)
    config = load_config(args.config, args.overrides, builtin="replay")
    trace = read_trace(args.trace, limit=args.limit)
    if args.arrivals == "timestamp" and not trace.has_timestamps:
        raise MemcliError(f"{trace.path}: --arrivals timestamp needs arrival times, and this trace has none",
                          "use --arrivals burst")
    check_fits(config, trace.requests, trace.path)
    result = run_side_by_side(config, trace.requests, args.arrivals, output_token_base(trace), args.max_steps)
    return result, (diff_document(result, config, args) if args.json else render(result))


def diff_document(result: StepDiff, config, args: argparse.Namespace) -> dict[str, Any]:
    """The --json document: the envelope, then the run and, when they diverged, both sides'
    observations at the first divergent step."""
    divergence = None
    if result.divergence is not None:
        sglang, memcli = result.divergence
        divergence = {"step": sglang.step, "fields": sglang.differing(memcli),
                      "sglang": dataclasses.asdict(sglang), "memcli": dataclasses.asdict(memcli)}
    return envelope("reference diff", {
        "trace": args.trace, "limit": args.limit, "arrivals": args.arrivals, "event_loop": result.event_loop,
        "steps": result.steps, "divergent": result.divergence is not None, "first_divergence": divergence,
        "reference_s": round(result.reference_s, 3), "memcli_s": round(result.memcli_s, 3),
        "notes": list(result.notes), "failure": result.failure,
    }, config)


def render(result: StepDiff) -> str:
    times = f"{result.event_loop} loop; reference {result.reference_s:.2f} s, memcli {result.memcli_s:.2f} s"
    notes = [f"note: {note}" for note in result.notes]
    if result.failure is not None:
        return "\n".join([*notes, f"failed: {result.failure}", f"{result.steps} steps compared before it ({times})"])
    if result.divergence is None:
        return "\n".join([*notes, f"0 divergent steps in {result.steps} steps ({times})"])
    sglang, memcli = result.divergence
    lines = [*notes, f"first divergent step: {sglang.step} (fields: {', '.join(sglang.differing(memcli)) or 'done'})",
             "  sglang:"] + [f"    {line}" for line in sglang.lines()]
    lines += ["  memcli:"] + [f"    {line}" for line in memcli.lines()]
    lines.append(f"{result.steps} steps run ({times})")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        result, text = run(argv)
    except MemcliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        hint = getattr(exc, "hint", None)
        if hint:
            print(f"hint: {hint}", file=sys.stderr)
        return 2
    if isinstance(text, dict):
        print_json(text)
    else:
        print(text)
    return 0 if result.divergence is None and result.failure is None else 1


if __name__ == "__main__":
    sys.exit(main())
