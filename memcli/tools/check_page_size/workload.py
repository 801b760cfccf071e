"""Workloads for `check-page-size`: the built-in paged workload, the bench batch, and traces.

The built-in workload is deterministic (`runtime.seed`) and made to hit every paged code path
on a small pool: shared system prompts (radix hits, divergence mid-page), prompts of odd length
(every prompt ends mid-page), long prompts (chunked prefill, chunks cut after a short request
in the same batch), outputs of up to 160 tokens (decode across page boundaries), waves that
overfill the pool (eviction, retraction), forced retractions, aborts of a waiting, a running
and a chunked request, and a last wave that arrives after the stack went idle (the idle check
with a full tree, then hits on what the tree kept).

The dynamic run of the built-in workload uses its own small pool; every config field it
changes is returned as an `Adjustment`, and shown to the user.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from memcli.config import Config, replace
from memcli.mem_cache.pages import cdiv
from memcli.workload.readers import read_trace
from memcli.workload.spec import RequestSpec, output_token_base

AbortWhere = Literal["waiting", "running", "chunked"]

POOL_TOKENS = 4096
CONTEXT_LEN = 2048
ROWS = 32
CHUNK_TOKENS = 256
PREFILL_TOKENS = 1024
RETRACT_EVERY = 120  # forced retractions; rarer than memory-pressure ones would be drowned out
NEW_TOKEN_RATIO = 0.1
RATIO_DECAY_STEPS = 10
SYSTEM_PROMPT_LENS = (181, 333, 77)
WAVES, WAVE_SIZE, WAVE_GAP_MS = 5, 6, 120.0
LAST_WAVE_MS = 10_000.0  # long after the others: the stack goes idle with a full tree first
BENCH_PROMPT_LENS = (37, 91, 151, 201)  # odd: every prompt ends mid-page


@dataclass(frozen=True)
class AbortPlan:
    """Abort one request that is `where`, at the first step >= `from_step` that has one."""

    from_step: int
    where: AbortWhere


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    requests: list[RequestSpec]
    aborts: tuple[AbortPlan, ...] = ()
    retract_every: int = 0
    output_token_base: int = 1 << 40

    @property
    def step_bound(self) -> int:
        """Enough steps to finish every request one token at a time, plus one per prefill chunk."""
        return sum(r.output_len + r.input_len // 64 + 2 for r in self.requests)

    def steps_one_by_one(self, chunk_tokens: int | None) -> int:
        """Steps that finish every request when each runs alone, one after another: its prefill
        chunks (of `chunk_tokens`; None: one chunk), its decode steps, and one idle step before it
        (the scheduler waits for its arrival). Concurrent requests need fewer; a retraction more."""
        def chunks(n: int) -> int:
            return 1 if not chunk_tokens or chunk_tokens < 1 else cdiv(n, chunk_tokens)
        return sum(chunks(r.input_len) + r.output_len + 1 for r in self.requests)


@dataclass(frozen=True)
class Adjustment:
    """One config field the command changed for a run, and why."""

    key: str
    old: Any
    new: Any
    why: str

    def __str__(self) -> str:
        return f"{self.key}: {self.old} -> {self.new} ({self.why})"

    def to_dict(self) -> dict:
        return {"key": self.key, "old": self.old, "new": self.new, "why": self.why}


def with_changes(config: Config, changes: dict[str, tuple[Any, str]]) -> tuple[Config, list[Adjustment]]:
    """Apply `{"section.key": (value, why)}`; return the new config and the fields that changed."""
    adjustments, sections = [], {}
    for key, (value, why) in changes.items():
        section, field = key.split(".")
        old = getattr(getattr(config, section), field)
        if old != value:
            adjustments.append(Adjustment(key, old, value, why))
            sections.setdefault(section, {})[field] = value
    return (replace(config, **sections) if sections else config), adjustments


def indices_only(config: Config) -> tuple[Config, list[Adjustment]]:
    """No K/V buffers: the checks read slot ids only and the simulated forward writes no K/V."""
    return with_changes(config, {"memory.kv_pool": ("indices", "the checks read slot ids, never K/V")})


def builtin_config(config: Config) -> tuple[Config, list[Adjustment]]:
    """The user's config with the small pool and budgets the built-in workload is made for."""
    ps = config.page_size
    pool = max(POOL_TOKENS, 64 * ps)
    why = "the built-in workload runs on a small pool to force eviction and retraction"
    return with_changes(config, {
        "memory.kv_budget_gib": (None, why),
        "memory.max_total_tokens": (pool, why),
        "memory.max_context_len": (min(CONTEXT_LEN, pool), "fits the built-in workload's longest request"),
        "memory.max_running_requests": (ROWS, "enough request rows for the built-in waves"),
        "memory.kv_pool": ("indices", "the checks read slot ids, never K/V"),
        "scheduler.chunked_prefill_size": (max(CHUNK_TOKENS, ps), "small chunks so that long prompts are chunked"),
        "scheduler.max_prefill_tokens": (max(PREFILL_TOKENS, 4 * ps), "prefill budget of the built-in waves"),
        "scheduler.init_new_token_ratio": (NEW_TOKEN_RATIO, "reserve little decode room: memory pressure retracts"),
        "scheduler.new_token_ratio_decay_steps": (RATIO_DECAY_STEPS, "back to little reserve soon after a retraction"),
    })


def _odd_length(ids: np.ndarray) -> np.ndarray:
    """Drop the last token when the length is even: odd prompts end mid-page at every ps > 1."""
    return ids if len(ids) % 2 else ids[:-1]


def builtin_workload(seed: int) -> Workload:
    """Five waves of six requests over three shared system prompts; see the module docstring."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(1, 30_000, n) for n in SYSTEM_PROMPT_LENS]
    prompts: list[np.ndarray] = []
    specs = []
    for wave in range(WAVES):
        for k in range(WAVE_SIZE):
            index = len(prompts)
            if k == WAVE_SIZE - 1 and index >= 3:
                ids = prompts[index - 3]  # an exact repeat: the match is capped at len - 1
            else:
                long_prompt = k == WAVE_SIZE - 2
                suffix = int(rng.integers(401, 800)) if long_prompt else int(rng.integers(9, 200))
                ids = _odd_length(np.concatenate([systems[index % 3], rng.integers(30_000, 60_000, suffix)]))
            prompts.append(ids)
            output = int(rng.integers(24, 80)) if len(ids) > 600 else int(rng.integers(24, 160))
            arrival = LAST_WAVE_MS if wave == WAVES - 1 else wave * WAVE_GAP_MS
            specs.append(RequestSpec.from_ids(f"w{wave}r{k}", ids, output, arrival_ms=arrival))
    aborts = (AbortPlan(10, "waiting"), AbortPlan(20, "chunked"), AbortPlan(30, "running"))
    description = (f"built-in: {len(specs)} requests in {WAVES} waves over {len(systems)} shared prompts,"
                   f" seed {seed}")
    return Workload("default", description, specs, aborts, RETRACT_EVERY)


def bench_workload(config: Config) -> Workload:
    """One static batch for the bench path (null cache): prompts ending mid-page, decode past a
    page boundary. Lengths shrink to fit small contexts."""
    ps = config.page_size
    context, pool = config.memory.max_context_len, config.pool_size
    output = max(ps + 3, 8)
    specs = []
    for i, length in enumerate(BENCH_PROMPT_LENS):
        room = min(context - config.context_need(0, output), pool // len(BENCH_PROMPT_LENS) - output - 1)
        length = max(1, min(length, room))
        ids = np.arange(1 + 1000 * i, 1 + 1000 * i + length, dtype=np.int64)
        specs.append(RequestSpec.from_ids(f"bench{i}", ids, max(1, min(output, context - length)), arrival_ms=0.0))
    return Workload("bench", f"bench batch: {len(specs)} requests, one prefill then decode", specs)


def trace_workload(path: str | Path, num_requests: int) -> Workload:
    """The first `num_requests` requests of a trace (Mooncake or memcli JSONL)."""
    trace = read_trace(path, limit=num_requests)
    description = f"trace {path}: first {trace.num_requests} requests ({trace.format})"
    return Workload(str(path), description, trace.requests, (), 0, output_token_base(trace))
