"""The cases of a bench-one-batch sweep, and the capacity check made before any of them runs.

A case is one static batch: `batch_size` requests of `input_len` prompt tokens, of which the
first `prefix_len` are already cached, then `output_len` decode steps, at one page size. Every
request ends holding `input_len + output_len` KV slots, rounded up to whole pages.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from memcli.config import GIB, Config
from memcli.errors import CapacityError, MemcliError
from memcli.mem_cache.pages import align_up


@dataclass(frozen=True)
class Case:
    batch_size: int
    input_len: int
    output_len: int
    prefix_len: int
    page_size: int

    @property
    def seq_len(self) -> int:
        """Tokens of one request at its finish."""
        return self.input_len + self.output_len

    @property
    def tokens_per_req(self) -> int:
        """KV slots one request holds at its finish (whole pages, tree-held prefix included)."""
        return align_up(self.seq_len, self.page_size)

    @property
    def kv_tokens_needed(self) -> int:
        return self.batch_size * self.tokens_per_req

    @property
    def label(self) -> str:
        return (f"bs={self.batch_size} input={self.input_len} output={self.output_len}"
                f" prefix={self.prefix_len} page_size={self.page_size}")


def plan_cases(batch_sizes: Sequence[int], input_lens: Sequence[int], output_lens: Sequence[int],
               prefix_lens: Sequence[int], page_sizes: Sequence[int]) -> list[Case]:
    """Every combination, grouped by page size (one stack is built per page size)."""
    check_values("--batch-size", batch_sizes, minimum=1)
    check_values("--input-len", input_lens, minimum=1)
    check_values("--output-len", output_lens, minimum=0)
    check_values("--prefix-len", prefix_lens, minimum=0)
    for ps in page_sizes:
        if ps < 1 or ps & (ps - 1):
            raise MemcliError(f"--page-size {ps}: not a power of two", hint="use 1, 2, 4, ..., 64, 128")
    combos = itertools.product(_unique(page_sizes), _unique(batch_sizes), _unique(input_lens),
                               _unique(output_lens), _unique(prefix_lens))
    cases = [Case(bs, il, ol, pl, ps) for ps, bs, il, ol, pl in combos]
    for case in cases:
        if case.prefix_len >= case.input_len:
            raise MemcliError(
                f"--prefix-len {case.prefix_len} is not shorter than --input-len {case.input_len}",
                hint="at least one prompt token must be computed: use a prefix below the input length",
            )
    return cases


def check_values(option: str, values: Sequence[int], minimum: int) -> None:
    if not values:
        raise MemcliError(f"{option}: no value given", hint=f"for example {option} 8 (or a list: {option} 1,8)")
    bad = [v for v in values if v < minimum]
    if bad:
        raise MemcliError(f"{option} {bad[0]}: must be at least {minimum}", hint=f"pass values >= {minimum}")


def _unique(values: Sequence[int]) -> list[int]:
    return list(dict.fromkeys(values))


def check_cases_fit(cases: Sequence[Case], configs: dict[int, Config]) -> None:
    """Raise `CapacityError` for the first case that `configs[case.page_size]` cannot hold; the
    hint's values are computed over every case, so that following it makes them all fit."""
    for case in cases:
        try:
            check_capacity(case, configs[case.page_size])
        except CapacityError as exc:
            raise CapacityError(exc.message, hint=fit_all_hint(cases, configs)) from None


def fit_all_hint(cases: Sequence[Case], configs: dict[int, Config]) -> str:
    """What makes every case fit: the largest batch size that fits every case's shape, and
    the settings (context, pool, request rows) that hold the largest need among the cases."""
    parts = []
    context = max(c.seq_len for c in cases)
    pool = max(max(c.kv_tokens_needed for c in cases), context)
    pool = align_up(pool, max(c.page_size for c in cases))
    rows = max(c.batch_size for c in cases)
    short_context = any(c.seq_len > configs[c.page_size].memory.max_context_len for c in cases)
    if short_context:
        shortest = min(configs[c.page_size].memory.max_context_len for c in cases)
        parts.append(f"keep --input-len + --output-len <= {shortest}")
    else:
        fits = min(min(configs[c.page_size].memory.max_running_requests,
                       configs[c.page_size].pool_size // c.tokens_per_req) for c in cases)
        parts.append(f"largest batch size that fits: {fits}" if fits else
                     f"one request alone needs {max(c.tokens_per_req for c in cases):,} tokens")
    settings = []
    if short_context:
        settings.append(f"--set memory.max_context_len={context}")
    if any(pool > configs[c.page_size].pool_size for c in cases):
        settings.append(_pool_setting(pool, next(iter(configs.values()))))
    if any(rows > configs[c.page_size].memory.max_running_requests for c in cases):
        settings.append(f"--set memory.max_running_requests={rows}")
    if settings:
        parts.append(f"every case fits with {' '.join(settings)}")
    return "; ".join(parts)


def check_capacity(case: Case, config: Config) -> None:
    """Raise `CapacityError` (with what would fit) unless `config`'s pools can hold `case`.

    `config` must already carry the case's page size.
    """
    mem = config.memory
    if case.seq_len > mem.max_context_len:
        raise CapacityError(
            f"case {case.label}: a request of {case.input_len} + {case.output_len} = {case.seq_len} tokens"
            f" is longer than memory.max_context_len = {mem.max_context_len}",
            hint=f"keep --input-len + --output-len <= {mem.max_context_len}, or raise it"
                 f" (--set memory.max_context_len={case.seq_len}; the pool must hold it too)",
        )
    pool, rows = config.pool_size, mem.max_running_requests
    need = case.kv_tokens_needed
    if need <= pool and case.batch_size <= rows:
        return
    fits = min(rows, pool // case.tokens_per_req)
    raise CapacityError(
        f"case {case.label} does not fit: it needs {need:,} KV tokens ({case.batch_size} requests x"
        f" {case.tokens_per_req:,} tokens, whole pages) and {case.batch_size} request rows; the pool holds"
        f" {pool:,} tokens and the request table {rows} rows",
        hint=_capacity_hint(case, config, fits),
    )


def _capacity_hint(case: Case, config: Config, fits: int) -> str:
    parts = [f"largest batch size that fits: {fits}"] if fits else [
        f"one request alone needs {case.tokens_per_req:,} tokens"]
    if case.kv_tokens_needed > config.pool_size:
        parts.append(f"a pool of {case.kv_tokens_needed:,} tokens fits this case"
                     f" ({_pool_setting(case.kv_tokens_needed, config)})")
    if case.batch_size > config.memory.max_running_requests:
        parts.append(f"--set memory.max_running_requests={case.batch_size}")
    return "; ".join(parts)


def _pool_setting(tokens: int, config: Config) -> str:
    if config.memory.max_total_tokens is not None:
        return f"--set memory.max_total_tokens={tokens}"
    gib = math.ceil(tokens * config.model.bytes_per_token / GIB * 10) / 10
    return f"--set memory.kv_budget_gib={gib}"
