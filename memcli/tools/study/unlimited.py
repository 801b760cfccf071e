"""The unlimited-pool reference of a study (one per page size the study uses).

The reference is a pool large enough for every token of the trace, so nothing is ever
evicted: `sum over requests of (input + output) rounded up to pages`, with an indices-only
KV pool (no K/V memory; the free list and the tree are real). When that pool would exceed
`UNLIMITED_REPLAY_MAX_TOKENS` (the free list and the tree's slot tensors would take
gigabytes), the reference is the ceiling computed without the tree instead
(`memcli.tools.replay.ceiling`), and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from memcli.config import Config, replace
from memcli.mem_cache.pages import align_down, align_up
from memcli.tools.replay.runner import ReplayOptions, replay
from memcli.workload.spec import Trace

UNLIMITED_REPLAY_MAX_TOKENS = 1 << 25


@dataclass(frozen=True)
class Reference:
    """The unlimited-pool row. `method`: "replayed" (through the stack) or "computed" (the
    ceiling, without the tree)."""

    method: str
    note: str
    pool_tokens: Optional[int]
    cached_tokens: int
    hit_rate: float
    ceiling_hit_rate: float
    page_size: int = 1
    block_ratio: Optional[float] = None
    warmup_excluded_hit_rate: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "page_size": self.page_size, "method": self.method, "note": self.note, "pool_tokens": self.pool_tokens,
            "cached_tokens": self.cached_tokens, "hit_rate": round(self.hit_rate, 6),
            "ceiling_hit_rate": round(self.ceiling_hit_rate, 6),
            "block_ratio": None if self.block_ratio is None else round(self.block_ratio, 6),
            "warmup_excluded_hit_rate": None if self.warmup_excluded_hit_rate is None
            else round(self.warmup_excluded_hit_rate, 6),
        }


def unlimited_pool_tokens(trace: Trace, page_size: int) -> int:
    """Every token of the trace in whole pages (a request asking for 0 outputs still makes one)."""
    ps = page_size
    return sum(align_up(r.input_len + max(r.output_len, 1), ps) for r in trace.requests) + ps


def unlimited_config(config: Config, pool_tokens: int) -> Config:
    memory = {"max_total_tokens": pool_tokens, "kv_budget_gib": None, "kv_pool": "indices"}
    memory["max_context_len"] = min(config.memory.max_context_len, pool_tokens // config.page_size * config.page_size)
    return replace(config, memory=memory)


def reference_row(config: Config, trace: Trace, options: ReplayOptions, shared: np.ndarray) -> dict[str, Any]:
    """The reference at `config`'s page size, as a row (`Reference.to_dict`)."""
    return unlimited_reference(config, trace, options, shared).to_dict()


def unlimited_reference(config: Config, trace: Trace, options: ReplayOptions, shared: np.ndarray,
                        progress=None) -> Reference:
    """Replay `trace` with every token of it in the pool (nothing evicted), or compute the
    ceiling when that pool is over `UNLIMITED_REPLAY_MAX_TOKENS`."""
    ps = config.page_size
    pool = unlimited_pool_tokens(trace, ps)
    ceiling_tokens = int(align_down(shared, ps).sum())
    ceiling = ceiling_tokens / trace.input_tokens
    if pool > UNLIMITED_REPLAY_MAX_TOKENS:
        return Reference(
            "computed",
            f"the trace needs a {pool:,}-token pool, over the {UNLIMITED_REPLAY_MAX_TOKENS:,} replayed;"
            " this row is the ceiling computed without the tree (sequential, never evicting, page size"
            f" {ps})",
            None, ceiling_tokens, ceiling, ceiling, ps,
        )
    result = replay(unlimited_config(config, pool), trace, ReplayOptions(options.arrivals), progress, shared)
    p = result.prefix
    return Reference(
        "replayed",
        f"replayed with a {pool:,}-token indices-only pool (every token of the trace in pages of {ps}:"
        f" nothing is evicted), {options.arrivals} arrivals",
        pool, p.cached_tokens, p.hit_rate, p.ceiling_hit_rate, ps, p.block_ratio, p.warmup_excluded_hit_rate,
    )
