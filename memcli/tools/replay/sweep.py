"""`--sweep KEY=v1,v2,...`: one replay per value, plus the unlimited-pool reference.

The reference is a pool large enough for every token of the trace, so nothing is ever
evicted: `sum over requests of (input + output) rounded up to pages`, with an indices-only
KV pool (no K/V memory; the free list and the tree are real). When that pool would exceed
`UNLIMITED_REPLAY_MAX_TOKENS` (the free list and the tree's slot tensors would take
gigabytes), the reference is the ceiling computed without the tree instead
(`memcli.tools.replay.ceiling`), and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from memcli.config import GIB, Config, parse_override, replace
from memcli.errors import MemcliError
from memcli.mem_cache.pages import align_down, align_up
from memcli.tools.replay.result import ReplayResult
from memcli.tools.replay.runner import ReplayOptions, check_fits, check_options, replay
from memcli.workload.spec import Trace

UNLIMITED_REPLAY_MAX_TOKENS = 1 << 25
# Sweeping one of two alternative pool-size keys clears the other.
_ALTERNATIVES = {"memory.max_total_tokens": "memory.kv_budget_gib", "memory.kv_budget_gib": "memory.max_total_tokens"}


@dataclass(frozen=True)
class SweepSpec:
    key: str
    values: tuple[Any, ...]

    def overrides(self, value: Any, base: Config) -> list[str]:
        """`--set` overrides that select `value`. A pool-size value also clears the alternative
        key, and shortens `memory.max_context_len` to the pool when it is longer (every request
        is still checked against both before the replay)."""
        extra = [f"{self.key}={_yaml(value)}"]
        if self.key in _ALTERNATIVES:
            extra.append(f"{_ALTERNATIVES[self.key]}=null")
            pool = _pool_tokens(self.key, value, base)
            if pool is not None and 0 < pool < base.memory.max_context_len:
                extra.append(f"memory.max_context_len={pool}")
        return extra


def _pool_tokens(key: str, value: Any, base: Config) -> Optional[int]:
    if type(value) not in (int, float):
        return None  # not a size: the config validation names the problem
    tokens = int(value) if key == "memory.max_total_tokens" else int(value * GIB // base.model.bytes_per_token)
    return tokens // base.page_size * base.page_size


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def parse_sweep(text: str) -> SweepSpec:
    """`memory.max_total_tokens=100000,200000` -> SweepSpec; values are read as YAML."""
    usage = "for example --sweep memory.max_total_tokens=100000,200000 or --sweep cache.eviction_policy=lru,lfu"
    if "=" not in text:
        raise MemcliError(f"--sweep {text!r}: expected KEY=v1,v2,...", usage)
    key, _, raw = text.partition("=")
    (section, name), _ = parse_override(f"{key.strip()}=0")
    parts = [part.strip() for part in raw.split(",")]
    if not all(parts):
        raise MemcliError(f"--sweep {text!r}: empty value in the list", usage)
    values = tuple(parse_override(f"{section}.{name}={part}")[1] for part in parts)
    return SweepSpec(f"{section}.{name}", values)


@dataclass(frozen=True)
class SweepRow:
    value: Any
    result: ReplayResult


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
    block_ratio: Optional[float] = None
    warmup_excluded_hit_rate: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method, "note": self.note, "pool_tokens": self.pool_tokens,
            "cached_tokens": self.cached_tokens, "hit_rate": round(self.hit_rate, 6),
            "ceiling_hit_rate": round(self.ceiling_hit_rate, 6),
            "block_ratio": None if self.block_ratio is None else round(self.block_ratio, 6),
            "warmup_excluded_hit_rate": None if self.warmup_excluded_hit_rate is None
            else round(self.warmup_excluded_hit_rate, 6),
        }


@dataclass(frozen=True)
class SweepResult:
    key: str
    arrivals: str
    config: Config
    rows: tuple[SweepRow, ...]
    reference: Reference


def unlimited_pool_tokens(trace: Trace, page_size: int) -> int:
    """Every token of the trace in whole pages (a request asking for 0 outputs still makes one)."""
    ps = page_size
    return sum(align_up(r.input_len + max(r.output_len, 1), ps) for r in trace.requests) + ps


def unlimited_config(config: Config, pool_tokens: int) -> Config:
    memory = {"max_total_tokens": pool_tokens, "kv_budget_gib": None, "kv_pool": "indices"}
    memory["max_context_len"] = min(config.memory.max_context_len, pool_tokens // config.page_size * config.page_size)
    return replace(config, memory=memory)


def run_sweep(spec: SweepSpec, make_config: Callable[[list[str]], Config], trace: Trace, options: ReplayOptions,
              shared: np.ndarray, progress_for: Callable[[str], Any] = lambda label: None) -> SweepResult:
    """Replay once per value (every config is built and checked before the first replay),
    then the reference. `make_config(extra_overrides)` loads the base config with them."""
    base = make_config([])
    configs = [make_config(spec.overrides(value, base)) for value in spec.values]
    for config in configs:
        check_options(trace, config, options)
        check_fits(config, trace)
    rows = []
    for value, config in zip(spec.values, configs):
        rows.append(SweepRow(value, replay(config, trace, options, progress_for(f"{spec.key}={value}"), shared)))
        if rows[-1].result.interrupted:
            raise KeyboardInterrupt  # no partial sweep: the caller reports the interruption
    reference = _reference(base, trace, options, shared, progress_for("unlimited pool"))
    return SweepResult(spec.key, options.arrivals, base, tuple(rows), reference)


def _reference(config: Config, trace: Trace, options: ReplayOptions, shared: np.ndarray, progress) -> Reference:
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
            None, ceiling_tokens, ceiling, ceiling,
        )
    result = replay(unlimited_config(config, pool), trace, ReplayOptions(options.arrivals), progress, shared)
    p = result.prefix
    return Reference(
        "replayed",
        f"replayed with a {pool:,}-token indices-only pool (every token of the trace in pages of {ps}:"
        f" nothing is evicted), {options.arrivals} arrivals",
        pool, p.cached_tokens, p.hit_rate, p.ceiling_hit_rate, p.block_ratio, p.warmup_excluded_hit_rate,
    )
