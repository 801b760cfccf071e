"""`python -m memcli.tools.replay.floor [TRACE]`: the array work of a replay alone, as a floor.

For every request of the trace, in order, and with nothing else (no tree, no scheduler, no
per-step work), the bulk copies a replay at page size 1 makes for it:

    the prompt built from the trace (`RequestSpec.input_ids`, with room for the outputs)
    its new slots taken from a ring of free slots, and written into a request row (int32)
    the row's new part cast to int64 (the tree's value at the checkpoint)
    the row's whole prompt cast to int64 (the next round's prefix)
    as many slots written back into the ring (the free)

A request's new part is its prompt past the longest prefix any earlier request shares with
it (`ceiling.shared_prefix_lens`), the most a cache could hold: fewer new tokens than any
replay copies, so the time is a floor for this design on this machine, whatever the pool.
It prints each round's seconds and the requests per second of the fastest.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from memcli.errors import MemcliError
from memcli.tools.replay.ceiling import shared_prefix_lens
from memcli.workload.readers import read_trace
from memcli.workload.spec import Trace

DEFAULT_TRACE = Path("/work/shared/traces/conversation_trace.jsonl")  # the bench's trace too
ROWS = 64  # request rows the copies cycle through (SGLang 0.5.23 hands out the rows freed last first: few are hot)


def new_prompt_tokens(trace: Trace, shared: np.ndarray) -> int:
    """The prompt tokens past each request's shared prefix (`shared`), over the trace."""
    return trace.input_tokens - int(shared.sum())


def array_work(trace: Trace, shared: np.ndarray) -> float:
    """One pass of the copies over `trace` (see the module docstring); its seconds."""
    longest = max((r.input_len for r in trace.requests), default=0)
    cap = max(2 * longest, 1)
    ring = np.arange(1, cap + 1, dtype=np.int64)
    table = np.zeros((ROWS, max(longest, 1)), dtype=np.int32)
    table.fill(0)  # its pages faulted in now: the first touch of new memory is not the copies' cost
    head = 0
    start = time.perf_counter()
    for i, (spec, pre) in enumerate(zip(trace.requests, shared.tolist())):
        prompt = spec.input_ids(room=spec.output_len)
        n = prompt.shape[0]
        new = n - pre
        at = head % (cap - new + 1)
        row = table[i % ROWS]
        row[pre:n] = ring[at : at + new]  # the extend write
        value = row[pre:n].astype(np.int64)  # the tree's value
        row[:n].astype(np.int64)  # the next round's prefix
        ring[at : at + new] = value  # the free
        head += new
    elapsed = time.perf_counter() - start
    if head != new_prompt_tokens(trace, shared):
        raise AssertionError(f"copied {head} new tokens, expected {new_prompt_tokens(trace, shared)}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memcli.tools.replay.floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None, help="the first N requests only")
    args = parser.parse_args(argv)
    try:
        for name, value in (("--rounds", args.rounds), ("--limit", args.limit)):
            if value is not None and value < 1:
                raise MemcliError(f"{name} must be at least 1, got {value}", f"leave {name} out, or give it 1 or more")
        trace = read_trace(args.trace, limit=args.limit)
    except MemcliError as exc:
        print(exc.lines(), file=sys.stderr)
        return exc.exit_code
    shared = shared_prefix_lens(trace)
    rounds = [array_work(trace, shared) for _ in range(args.rounds)]
    print(f"array work of {trace.num_requests:,} requests ({new_prompt_tokens(trace, shared):,} new prompt tokens): "
          f"rounds {', '.join(f'{s:.3f}' for s in rounds)} s; fastest {trace.num_requests / min(rounds):,.0f} requests/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
