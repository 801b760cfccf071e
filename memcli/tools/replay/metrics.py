"""What a replay measures: per-step series, per-request hits, and the result sections.

Collectors (`StepSeries`, `EvictionLog`) are appended to while the replay runs; the frozen
`*Stats` sections are computed from them once it ends. Every hit rate names its definition
in `DEFINITIONS`, which the reports print.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from memcli.mem_cache.pages import align_down, num_pages, whole_pages
from memcli.steps import VLLM_WINDOW_REQUESTS, VllmReported

WARMUP_FRACTION = 0.5
WINDOW_REQUESTS = 1000

DEFINITIONS = {
    "hit_rate": "cached_tokens / input_tokens: prompt tokens matched in the prefix cache when each request was"
                " first admitted (page-floored, at most input_len - 1), over all prompt tokens, from a cold start",
    "block_ratio": "hit blocks / blocks: a request's hit blocks are the whole trace blocks (block_size tokens)"
                   " inside its cached prefix, its blocks ceil(input_len / block_size) (Mooncake Table 1)",
    "warmup_excluded": "hit_rate over the requests after the first 50% (trace order), token weighted"
                       " (KVCache.AI kvcache-simulator)",
    "last_1000": "hit_rate over the last 1,000 requests (trace order), token weighted (vLLM's logged window)",
    "per_request_mean": "mean over the admitted requests of cached_tokens / input_len: every request weighs the"
                        " same, whatever its length",
    "page_hit_rate": "hit pages / prompt pages: cached_tokens / page_size over ceil(input_len / page_size), summed"
                     " over the admitted requests",
    "sglang_batch": "SGLang's cache hit rate of one prefill batch, as its scheduler logs it: #cached-token /"
                    " (#new-token + #cached-token), #cached-token the prefixes of the requests the batch admits"
                    " (0 for a chunked request's next piece), #new-token their extend tokens rounded up to pages;"
                    " given as the mean over prefill batches and the last batch's value (what SGLang's gauge keeps)",
    "sglang_cumulative": "SGLang's per-batch counts summed over every prefill batch: sum #cached-token /"
                         " (sum #new-token + sum #cached-token)",
    "vllm": "vLLM's prefix-cache hit rate: hits / queries in tokens, counted at every admission (again after a"
            " retraction): queries the request's tokens at that time (prompt and output so far), hits those matched",
    "vllm_reported": "vLLM's own PrefixCacheStats (vllm-0.33 only): queries and hits of fresh admissions"
                     " (queries all of the request's tokens at admission), re-admissions of preempted"
                     " requests apart; per_run = hits / queries over the whole run; logged_window = what"
                     " vLLM's logger logs last (CachingMetrics: the steps' stats aggregated over the most"
                     " recent 1,000 fresh requests, whole steps dropped oldest first, the latest kept)",
    "belady": "hit_rate of a second replay with cache.eviction_policy belady (offline: the evictable leaf whose"
              " first page is next used furthest in the future goes first), everything else equal",
    "ceiling": "what a cache that never evicts gives when requests run one after another: per request the longest"
               " prefix shared with an earlier prompt, at most input_len - 1, floored to a page; computed"
               " without the radix tree",
    "lost_to_page_alignment": "sum over requests of shared - floor(shared, page_size), where shared is the"
                              " ceiling's token-level (page size 1) match: what page size 1 would add to the ceiling",
    "sub_page_prefix_requests": "requests that share a prefix with an earlier prompt, but shorter than one page:"
                                " they can never hit",
    "lost_to_capacity_and_timing": "ceiling - cached_tokens: sharing the ceiling counts that the replay did not"
                                   " get: prefixes evicted before their reuse, requests running concurrently (both"
                                   " compute a shared prefix before either has cached it, so it is lost without any"
                                   " eviction), and admission order (negative when reordering helped)",
    "partial_page_waste": "slots of a request's last page that it owns but has not filled yet (at most page_size - 1"
                          " per running request; none at page size 1)",
    "returned_to_free_list": "slots handed back to the allocator (a free call and its tokens, whole pages); a"
                             " finished request's tokens that the prefix cache keeps are not freed until evicted",
    "no_request_holds_memory": "at the end no request holds a slot or a row: every slot is free or evictable"
                               " in the prefix cache",
}


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {"p50": 0.0, "p90": 0.0, "max": 0.0}
    p50, p90 = np.percentile(values, [50, 90])
    return {"p50": float(p50), "p90": float(p90), "max": float(values.max())}


def _time_weights(time_ms: np.ndarray) -> np.ndarray:
    """State recorded after step k lasts until step k + 1 (the last one weighs nothing).
    Falls back to equal weights when the clock never moved."""
    weights = np.diff(time_ms, append=time_ms[-1]) if len(time_ms) else time_ms
    if len(weights) and weights.sum() <= 0:
        weights = np.ones_like(time_ms)
    return weights


def _mean(values: np.ndarray, weights: np.ndarray) -> float:
    return float(np.average(values, weights=weights)) if len(values) else 0.0


class StepSeries:
    """One entry per scheduler step, in compact arrays (steps can number in the millions)."""

    FIELDS = ("time_ms", "running", "waiting", "available", "evictable", "protected", "held_tokens", "held_pages",
              "host_used", "d2h_bytes", "h2d_bytes")

    def __init__(self) -> None:
        self.time_ms = array("d")
        self.ints = {name: array("q") for name in self.FIELDS[1:]}

    def append(self, record) -> None:
        self.time_ms.append(record.time_ms)
        ints = self.ints
        ints["running"].append(record.running)
        ints["waiting"].append(record.waiting)
        ints["available"].append(record.available)
        ints["evictable"].append(record.evictable)
        ints["protected"].append(record.protected)
        ints["held_tokens"].append(record.held_tokens)
        ints["held_pages"].append(record.held_pages)
        ints["host_used"].append(record.host_used)
        ints["d2h_bytes"].append(record.d2h_bytes)
        ints["h2d_bytes"].append(record.h2d_bytes)

    def extend(self, run) -> None:
        """The steps of a `StepRun`, as `append` of each of its records."""
        n = len(run.time_ms)
        # Every field of `FIELDS` by name (one the run lacks raises): a list per step, or a value for all.
        columns = {"running": run.batch_size, "waiting": run.waiting, "available": run.available,
                   "evictable": run.evictable, "protected": run.protected, "held_tokens": run.held_tokens,
                   "held_pages": run.held_pages, "host_used": run.host_used, "d2h_bytes": 0, "h2d_bytes": 0}
        self.time_ms.extend(run.time_ms)
        for name, values in self.ints.items():
            value = columns[name]
            values.extend(value if isinstance(value, list) else array("q", (value,)) * n)

    def __len__(self) -> int:
        return len(self.time_ms)

    def arrays(self, pool_size: int, page_size: int) -> dict[str, np.ndarray]:
        """Every field plus the derived occupancy: `used_tokens` (slots holding a token's KV:
        cached or owned by a request), `used_pages` (pages handed out), `waste_tokens`
        (unfilled slots of pages that requests own)."""
        out = {"time_ms": np.frombuffer(self.time_ms, dtype=np.float64)}
        out.update({name: np.frombuffer(values, dtype=np.int64) for name, values in self.ints.items()})
        out["used_tokens"] = out["evictable"] + out["protected"] + out["held_tokens"]
        out["used_pages"] = whole_pages(pool_size - out["available"], page_size)
        out["waste_tokens"] = out["held_pages"] * page_size - out["held_tokens"]
        return out


class IntColumn:
    """Ints appended in order, kept as one value and a count while every one is that value
    (vLLM's evicted blocks all hold `block_size` tokens and have no known last or next use:
    millions of equal entries), as an int64 array from the first that differs."""

    __slots__ = ("value", "count", "values")

    def __init__(self):
        self.value, self.count = 0, 0
        self.values: array | None = None

    def __len__(self) -> int:
        return self.count if self.values is None else len(self.values)

    def append(self, value: int) -> None:
        self.extend_run(value, 1)

    def extend_run(self, value: int, n: int) -> None:
        """`n` times `value`."""
        if n <= 0:
            return
        if self.values is None:
            if value == self.value or not self.count:
                self.value, self.count = value, self.count + n
                return
            self._spill()
        self.values.extend(array("q", [value]) * n)

    def _spill(self) -> None:
        self.values = array("q", [self.value]) * self.count

    def numpy(self) -> np.ndarray:
        """The entries as an int64 array; a read-only view of one value while they are all it."""
        if self.values is None:
            return np.broadcast_to(np.int64(self.value), (self.count,))
        return np.frombuffer(self.values, dtype=np.int64)


@dataclass
class EvictionLog:
    """Evicted tree nodes: sizes, ages (simulated ms), hit counts, and the requests (trace
    indices, -1: none) that last used and next use their first page."""

    tokens: IntColumn = field(default_factory=IntColumn)
    age_ms: array = field(default_factory=lambda: array("d"))
    hits: array = field(default_factory=lambda: array("q"))
    last_use: IntColumn = field(default_factory=IntColumn)
    next_use: IntColumn = field(default_factory=IntColumn)

    def drain(self, records) -> None:
        """Append the eviction records memory handed over (`MemoryManager.take_evictions`):
        a list of records, or vLLM's block pool's `BlockEvictions` (one size, arrays of ages
        and hits, no known uses)."""
        if isinstance(records, tuple):
            n = len(records.age)
            self.tokens.extend_run(records.tokens, n)
            self.age_ms.extend(records.age)
            self.hits.extend(records.hit_count)
            self.last_use.extend_run(-1, n)
            self.next_use.extend_run(-1, n)
            return
        for record in records:
            self.tokens.append(record.tokens)
            self.age_ms.append(record.age)
            self.hits.append(record.hit_count)
            self.last_use.append(record.last_use)
            self.next_use.append(record.next_use)


@dataclass(frozen=True)
class PrefixStats:
    """Prefix-cache hits of the admitted requests; see `DEFINITIONS` for every ratio."""

    requests: int
    input_tokens: int
    cached_tokens: int
    page_size: int
    block_size: int
    hit_blocks: int
    blocks: int
    warmup_input_tokens: int
    warmup_cached_tokens: int
    window_input_tokens: int
    window_cached_tokens: int
    shared_tokens: int
    ceiling_tokens: int
    sub_page_prefix_requests: int
    requests_with_hits: int
    per_request_mean_hit_rate: float = 0.0
    hit_pages: int = 0
    pages: int = 0
    batches: int = 0
    batch_cached_tokens: int = 0
    batch_new_tokens: int = 0
    batch_mean_hit_rate: float = 0.0
    last_batch_hit_rate: float = 0.0
    vllm_queries: int = 0
    vllm_hits: int = 0
    vllm_reported: "VllmReported | None" = None

    @property
    def hit_rate(self) -> float:
        return _ratio(self.cached_tokens, self.input_tokens)

    @property
    def page_hit_rate(self) -> float:
        return _ratio(self.hit_pages, self.pages)

    @property
    def sglang_cumulative_hit_rate(self) -> float:
        return _ratio(self.batch_cached_tokens, self.batch_new_tokens + self.batch_cached_tokens)

    @property
    def vllm_hit_rate(self) -> float:
        return _ratio(self.vllm_hits, self.vllm_queries)

    @property
    def block_ratio(self) -> float:
        return _ratio(self.hit_blocks, self.blocks)

    @property
    def warmup_excluded_hit_rate(self) -> float:
        return _ratio(self.warmup_cached_tokens, self.warmup_input_tokens)

    @property
    def last_1000_hit_rate(self) -> float:
        return _ratio(self.window_cached_tokens, self.window_input_tokens)

    @property
    def ceiling_hit_rate(self) -> float:
        return _ratio(self.ceiling_tokens, self.input_tokens)

    @property
    def lost_to_page_alignment(self) -> int:
        return self.shared_tokens - self.ceiling_tokens

    @property
    def lost_to_capacity_and_timing(self) -> int:
        return self.ceiling_tokens - self.cached_tokens


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def prefix_stats(input_lens: np.ndarray, cached: np.ndarray, shared: np.ndarray, page_size: int,
                 block_size: int, counters: "EngineCounters | None" = None) -> PrefixStats:
    """Hits of the requests with `cached >= 0` (admitted); arrays are per request in trace order.

    `shared` is the ceiling's token-level match of each request (`ceiling.shared_prefix_lens`);
    `counters`, what the scheduler counted per prefill batch and per admission.
    """
    counters = counters or EngineCounters.empty()
    admitted = cached >= 0
    inputs, hits, shared = input_lens[admitted], cached[admitted], shared[admitted]
    half = int(len(input_lens) * WARMUP_FRACTION)
    late = admitted.copy()
    late[:half] = False
    window = admitted.copy()
    window[: max(len(input_lens) - WINDOW_REQUESTS, 0)] = False
    return PrefixStats(
        requests=int(admitted.sum()),
        input_tokens=int(inputs.sum()),
        cached_tokens=int(hits.sum()),
        page_size=page_size,
        block_size=block_size,
        hit_blocks=int((hits // block_size).sum()),
        blocks=int(num_pages(inputs, block_size).sum()),
        warmup_input_tokens=int(input_lens[late].sum()),
        warmup_cached_tokens=int(cached[late].sum()),
        window_input_tokens=int(input_lens[window].sum()),
        window_cached_tokens=int(cached[window].sum()),
        shared_tokens=int(shared.sum()),
        ceiling_tokens=int(align_down(shared, page_size).sum()),
        sub_page_prefix_requests=int(((shared > 0) & (shared < page_size)).sum()),
        requests_with_hits=int((hits > 0).sum()),
        per_request_mean_hit_rate=float((hits / np.maximum(inputs, 1)).mean()) if len(inputs) else 0.0,
        hit_pages=int(whole_pages(hits, page_size).sum()),
        pages=int(num_pages(inputs, page_size).sum()),
        **counters.summary(),
    )


@dataclass(frozen=True)
class EngineCounters:
    """What the scheduler counted: per prefill batch SGLang's #cached-token and #new-token,
    per admission vLLM's queries and hits (see `DEFINITIONS`)."""

    batch_cached: np.ndarray
    batch_new: np.ndarray
    vllm_queries: int
    vllm_hits: int
    prefix_cache_steps: tuple = ()  # vLLM's per-step PrefixCacheStats (`SchedulerStats`)

    @classmethod
    def empty(cls) -> "EngineCounters":
        return cls(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 0, 0)

    def summary(self) -> dict:
        total = self.batch_cached + self.batch_new
        rates = self.batch_cached[total > 0] / total[total > 0]
        return {
            "batches": len(total), "batch_cached_tokens": int(self.batch_cached.sum()),
            "batch_new_tokens": int(self.batch_new.sum()),
            "batch_mean_hit_rate": float(rates.mean()) if len(rates) else 0.0,
            "last_batch_hit_rate": float(rates[-1]) if len(rates) else 0.0,
            "vllm_queries": self.vllm_queries, "vllm_hits": self.vllm_hits,
            "vllm_reported": VllmReported.of_steps(list(self.prefix_cache_steps)),
        }


@dataclass(frozen=True)
class OccupancyStats:
    """Pool occupancy over the replay, in tokens and in pages. Means are weighted by
    simulated time (a state lasts until the next step)."""

    pool_tokens: int
    page_size: int
    peak_used_tokens: int
    mean_used_tokens: float
    peak_used_pages: int
    mean_used_pages: float
    peak_waste_tokens: int
    mean_waste_tokens: float
    peak_evictable_tokens: int
    peak_protected_tokens: int

    @property
    def num_pages(self) -> int:
        return whole_pages(self.pool_tokens, self.page_size)

    @property
    def peak_token_fraction(self) -> float:
        return _ratio(self.peak_used_tokens, self.pool_tokens)

    @property
    def peak_page_fraction(self) -> float:
        return _ratio(self.peak_used_pages, self.num_pages)


def occupancy_stats(series: dict[str, np.ndarray], pool_tokens: int, page_size: int) -> OccupancyStats:
    weights = _time_weights(series["time_ms"])

    def peak(name: str) -> int:
        return int(series[name].max()) if len(series[name]) else 0

    return OccupancyStats(
        pool_tokens=pool_tokens,
        page_size=page_size,
        peak_used_tokens=peak("used_tokens"),
        mean_used_tokens=_mean(series["used_tokens"], weights),
        peak_used_pages=peak("used_pages"),
        mean_used_pages=_mean(series["used_pages"], weights),
        peak_waste_tokens=peak("waste_tokens"),
        mean_waste_tokens=_mean(series["waste_tokens"], weights),
        peak_evictable_tokens=peak("evictable"),
        peak_protected_tokens=peak("protected"),
    )


EVICTION_DEFINITIONS = {
    "age_ms": "simulated time from a node's insertion to its eviction",
    "hits_before_eviction": "matches that passed through the node before it was evicted",
    "reuse_distance": "for an evicted node whose first page a later request uses again: the requests (trace"
                      " order) and the simulated time between the admission of the last request that used it"
                      " before the eviction and the admission of the next one after it",
    "needed_again": "share of evicted tokens in nodes whose first page a later request uses again (it would have"
                    " hit, had the node stayed)",
}


@dataclass(frozen=True)
class EvictionStats:
    """Evicted tree nodes: how many, how big, how old (simulated ms), how often matched before,
    and (when the trace's future is known, `future_known`) how far their next use was and how
    many of their tokens were needed again. See `EVICTION_DEFINITIONS`."""

    policy: str
    evictions: int
    tokens_evicted: int
    age_ms: dict[str, float]
    hits_before_eviction: dict[str, float]
    future_known: bool = False
    future_missing: str = ""  # without the future: why (reuse distances are then not computed)
    reused_evictions: int = 0
    reuse_distance_requests: dict[str, float] = field(default_factory=lambda: _percentiles(np.zeros(0)))
    reuse_distance_ms: dict[str, float] = field(default_factory=lambda: _percentiles(np.zeros(0)))
    tokens_needed_again: int = 0

    @property
    def needed_again_share(self) -> float:
        return _ratio(self.tokens_needed_again, self.tokens_evicted)


def eviction_stats(log: EvictionLog, policy: str, admit_ms: np.ndarray | None = None,
                   future_known: bool = False, future_missing: str = "") -> EvictionStats:
    """`admit_ms`: per request in trace order, when it was admitted (NaN: never)."""
    tokens, last, nxt = log.tokens.numpy(), log.last_use.numpy(), log.next_use.numpy()
    reused = nxt >= 0
    both = reused & (last >= 0)
    distance_ms = np.zeros(0)
    if admit_ms is not None and both.any():
        distance_ms = admit_ms[nxt[both]] - admit_ms[last[both]]
        distance_ms = distance_ms[~np.isnan(distance_ms)]
    return EvictionStats(
        policy=policy,
        evictions=len(tokens),
        tokens_evicted=int(tokens.sum()),
        age_ms=_percentiles(np.frombuffer(log.age_ms, dtype=np.float64)),
        hits_before_eviction=_percentiles(np.frombuffer(log.hits, dtype=np.int64)),
        future_known=future_known,
        future_missing="" if future_known else future_missing,
        reused_evictions=int(reused.sum()),
        reuse_distance_requests=_percentiles((nxt[both] - last[both]).astype(np.float64)),
        reuse_distance_ms=_percentiles(distance_ms),
        tokens_needed_again=int(tokens[reused].sum()),
    )


@dataclass(frozen=True)
class QueueStats:
    """Running and waiting requests over the replay (time weighted mean, max)."""

    mean_running: float
    max_running: int
    mean_waiting: float
    max_waiting: int


def queue_stats(series: dict[str, np.ndarray]) -> QueueStats:
    weights = _time_weights(series["time_ms"])
    running, waiting = series["running"], series["waiting"]
    return QueueStats(
        mean_running=_mean(running, weights),
        max_running=int(running.max()) if len(running) else 0,
        mean_waiting=_mean(waiting, weights),
        max_waiting=int(waiting.max()) if len(waiting) else 0,
    )


def downsample(series: dict[str, np.ndarray], max_points: int) -> dict[str, list]:
    """At most `max_points` evenly spaced steps of every series (first and last kept)."""
    n = len(series["time_ms"])
    if n == 0:
        return {name: [] for name in series}
    index = np.unique(np.linspace(0, n - 1, min(n, max_points)).round().astype(np.int64))
    return {name: values[index].tolist() for name, values in series.items()}
