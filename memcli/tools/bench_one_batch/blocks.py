"""bench-one-batch on a block manager (an engine with `static_batch`, vLLM's): one case's
static batch timed through the verbs its scheduler calls, and its blocks checked.

The manager is host-side Python: every phase is timed by the wall clock on the host
(whatever `runtime.device` is), as it runs on a server's CPU. Phases, each timed from the
state before it (rebuilt from a fresh manager, untimed):

    prefill_memory   every request admitted: get_computed_blocks + allocate_slots + stats record
    decode_memory    one decode step: allocate_slots of one token per request (median over steps)
    free             every request freed

There is no `prefill` or `decode_step` phase (the model step and its KV store run in the
model runner, not the manager) and no block-table write (the model runner writes its own
from the block ids the scheduler hands it). The blocks of every case are checked against what
the engine's rules give (`BlockBatch.expected`): a mismatch fails the case's idle check.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from memcli import engines
from memcli.engines.base import BlockBatch, BlockFigures
from memcli.errors import MemcliError
from memcli.tools.bench_one_batch.cases import Case
from memcli.tools.bench_one_batch.phases import PhaseTiming, combine_steps, measure
from memcli.tools.bench_one_batch.results import CaseResult
from memcli.tools.bench_one_batch.runner import case_tokens

HOST = torch.device("cpu")
# The figures `expected` tallies (the others are state, read after the finish).
KV_STORE_NOTE = ("not timed on a block manager: the prefill, the decode step and the KV store run in the model"
                 " runner; this engine's memory path is its manager's host-side calls")
# What one call of each phase does on a block manager (the `blocks` record's `timed`).
BLOCK_PHASES = {
    "prefill_memory": "per request: get_computed_blocks + allocate_slots of the rest of the prompt"
                      " (full_sequence_must_fit) + record_prefix_cache_stats",
    "decode_memory": "per request: allocate_slots of one token (a new block at a block boundary)",
    "free": "per request: free (deepest block first)",
}
TALLIED = ("block_size", "hit_tokens", "prefill_blocks", "decode_blocks", "freed_blocks", "queries", "hits")


def decode_steps(case: Case, config: Any) -> int:
    """The bench's decode steps: `output_len - 1` under `semantics.bench_decode_steps`
    output_len_minus_1 (the prefill samples the first token), else `output_len`."""
    return max(case.output_len - (config.behaviour.bench_decode_steps == "output_len_minus_1"), 0)


def case_batch(make: Callable[..., BlockBatch], case: Case, config: Any, seed: int) -> BlockBatch:
    """The static batch of `case` built by `make(config, prompts, prefix_len, outputs)`: the
    prompts and outputs of `runner.case_tokens`, the same for every implementation."""
    if case.prefix_len and config.cache.kind == "none":
        raise MemcliError(f"--prefix-len {case.prefix_len}: with --tree-cache none prefix caching is off, so no"
                          " block of the prefix can be cached", hint="add --tree-cache radix (prefix caching on)")
    tokens = case_tokens(case, seed)
    return make(config, tokens[:, : case.input_len], case.prefix_len, tokens[:, case.input_len:])


def _to_decode(batch: BlockBatch, done: int) -> None:
    """From a fresh manager to before decode step `done` (its tokens sampled)."""
    batch.start()
    batch.prefill()
    for _ in range(done):
        batch.sample()
        batch.decode()
    batch.sample()


def _to_finish(batch: BlockBatch, steps: int) -> None:
    _to_decode(batch, steps - 1) if steps else (batch.start(), batch.prefill())
    if steps:
        batch.decode()


def time_batch(batch: BlockBatch, steps: int, repeat: int, warmup: int
               ) -> tuple[dict[str, PhaseTiming], list[float], BlockFigures]:
    """The three phases of `batch` (and each decode step's median); the figures after the finish."""
    timed = functools.partial(measure, device=HOST, repeat=repeat, warmup=warmup)
    phases = {"prefill_memory": timed(batch.prefill, setup=batch.start)}
    decode = [timed(batch.decode, setup=functools.partial(_to_decode, batch, k)) for k in range(steps)]
    phases["free"] = timed(batch.finish, setup=functools.partial(_to_finish, batch, steps))
    if decode:
        phases["decode_memory"] = combine_steps(decode)
    return phases, [d.median_us for d in decode], batch.figures()


def blocks_record(batch: BlockBatch, figures: BlockFigures, steps: int) -> dict:
    """The case's blocks, what the engine's rules give, and whether they agree."""
    expected = batch.expected(steps)
    wrong = [name for name in TALLIED if getattr(figures, name) != getattr(expected, name)]
    if figures.held_blocks:
        wrong.append("held_blocks")
    return {"setup": batch.setup, "timed": BLOCK_PHASES, "measured": figures._asdict(),
            "expected": {name: getattr(expected, name) for name in TALLIED}, "ok": not wrong, "differ": wrong}


def run_block_case(stack: Any, case: Case, options: Any) -> CaseResult:
    """One case on an engine with `static_batch` (`stack` carries the case's config); a
    `CaseResult` with the three memory-path phases and the `blocks` record."""
    config = stack.config
    batch = case_batch(engines.get(config).static_batch, case, config, options.seed)
    steps = decode_steps(case, config)
    phases, step_us, figures = time_batch(batch, steps, options.repeat, options.warmup)
    blocks = blocks_record(batch, figures, steps)
    idle = batch.idle()
    idle = {**idle, "ok": bool(idle.get("ok")) and blocks["ok"], "blocks_ok": blocks["ok"]}
    bs = figures.block_size
    return CaseResult(
        run_name=options.run_name, case=case, tree_cache=options.tree_cache, device=f"{HOST.type} (host)",
        backend="host python", timing_method=phases["prefill_memory"].method,
        cached_prefix_len=figures.hit_tokens // case.batch_size,
        prefill_new_tokens=case.batch_size * case.input_len - figures.hit_tokens,
        prefill_allocated_tokens=figures.prefill_blocks * bs, decode_allocated_tokens=figures.decode_blocks * bs,
        freed_tokens=figures.freed_blocks * bs, page_sizes={"block_size": bs}, phases=phases,
        decode_step_us=step_us, kv_store_note=KV_STORE_NOTE, idle=idle, blocks=blocks)
