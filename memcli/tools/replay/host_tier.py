"""What a replay with the host tier (`cache.kind: hiradix`) measures: prompt tokens by tier,
transfers, and the host pool's occupancy.

Tiers of one request's prompt, at its first admission (the same moment as the hit rate):

    device hit     matched on the device (the prefix it was admitted with, less what was loaded)
    host, loaded   matched on the host only and loaded back before the request ran
    host, skipped  matched on the host only, not loaded back (shorter than the load-back
                   threshold, over the quota, or no device room): recomputed
    miss           the rest of the prompt

device hit + host loaded = the cached tokens of the hit rate; the four add up to the prompt
tokens of the requests admitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TIER_DEFINITION = ("prompt tokens per tier at each request's first admission, over all prompt tokens: device hit"
                   " (matched on the device), host loaded (matched on the host only and loaded back), host"
                   " skipped (matched on the host only, recomputed: under load_back_threshold or no room), miss")


class TierLog:
    """Per request (trace order): tokens loaded back before admission and host hits skipped."""

    def __init__(self, num_requests: int):
        self.loaded = np.zeros(num_requests, dtype=np.int64)
        self.skipped = np.zeros(num_requests, dtype=np.int64)

    def harvest(self, index: int, req) -> None:
        if req.first_cached_tokens is None:
            return
        self.loaded[index] = min(req.host_loaded_len, req.first_cached_tokens)
        self.skipped[index] = req.first_host_skipped or 0


@dataclass(frozen=True)
class HostTierStats:
    """The host tier of one replay (token counts over all requests, transfers, occupancy)."""

    input_tokens: int
    device_hit_tokens: int
    host_loaded_tokens: int
    host_skipped_tokens: int
    host_pool_tokens: int
    peak_host_used_tokens: int
    mean_host_used_tokens: float
    transfers: dict  # `HostTierCounters.summary()`

    @property
    def miss_tokens(self) -> int:
        return self.input_tokens - self.device_hit_tokens - self.host_loaded_tokens - self.host_skipped_tokens

    def rate(self, tokens: int) -> float:
        return tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def rates(self) -> dict[str, float]:
        return {"device_hit": self.rate(self.device_hit_tokens), "host_loaded": self.rate(self.host_loaded_tokens),
                "host_skipped": self.rate(self.host_skipped_tokens), "miss": self.rate(self.miss_tokens)}

    def to_dict(self) -> dict:
        t = self.transfers
        return {
            "tokens": {"device_hit": self.device_hit_tokens, "host_loaded": self.host_loaded_tokens,
                       "host_skipped": self.host_skipped_tokens, "miss": self.miss_tokens,
                       "input": self.input_tokens},
            "hit_rate": {k: round(v, 6) for k, v in self.rates.items()},
            "definition": TIER_DEFINITION,
            "host_pool": {"tokens": self.host_pool_tokens, "peak_used_tokens": self.peak_host_used_tokens,
                          "mean_used_tokens": round(self.mean_host_used_tokens, 1),
                          "means": "weighted by simulated time"},
            "transfers": {key: (round(value, 3) if isinstance(value, float) else value) for key, value in t.items()},
        }


def host_tier_stats(log: TierLog, cached: np.ndarray, input_lens: np.ndarray, series: dict[str, np.ndarray],
                    counters) -> HostTierStats:
    """Sum the per-request tiers and read the occupancy series (`host_used`) and the counters."""
    admitted = cached >= 0
    cached_tokens = int(cached[admitted].sum())
    loaded = int(log.loaded[admitted].sum())
    skipped = int(log.skipped[admitted].sum())
    used = series.get("host_used", np.zeros(0, dtype=np.int64))
    time_ms = series["time_ms"]
    mean = 0.0
    if len(used) > 1 and time_ms[-1] > time_ms[0]:
        mean = float(np.average(used[:-1], weights=np.diff(time_ms))) if np.diff(time_ms).sum() > 0 else 0.0
    elif len(used):
        mean = float(used.mean())
    return HostTierStats(int(input_lens.sum()), cached_tokens - loaded, loaded, skipped, counters.size,
                         int(used.max()) if len(used) else 0, mean, counters.summary())


def tier_rows(stats: HostTierStats) -> list[tuple[str, str]]:
    """Key-value rows of the human report."""
    r, t = stats.rates, stats.transfers
    gb = 1e9
    return [
        ("device hit", f"{_pct(r['device_hit'])} ({stats.device_hit_tokens:,} tokens)"),
        ("host hit, loaded back", f"{_pct(r['host_loaded'])} ({stats.host_loaded_tokens:,})"),
        ("host hit, skipped (recomputed)", f"{_pct(r['host_skipped'])} ({stats.host_skipped_tokens:,})"),
        ("miss", f"{_pct(r['miss'])} ({stats.miss_tokens:,})"),
        ("host pool, peak / mean used", f"{stats.peak_host_used_tokens:,} / {stats.mean_host_used_tokens:,.0f} of"
                                        f" {stats.host_pool_tokens:,} tokens"),
        ("device -> host: GB, copies, busy s", f"{t['d2h_bytes'] / gb:,.2f}, {t['d2h_copies']:,}, {t['d2h_busy_ms'] / 1e3:,.2f}"),
        ("host -> device: GB, copies, busy s", f"{t['h2d_bytes'] / gb:,.2f}, {t['h2d_copies']:,}, {t['h2d_busy_ms'] / 1e3:,.2f}"),
        ("prefill wait for load-backs (s)", f"{t['load_wait_ms'] / 1e3:,.3f}"),
        ("write-backs (nodes), wait (s)", f"{t['write_backs']:,}, {t['write_back_stall_ms'] / 1e3:,.3f}"),
        ("host evictions (tokens)", f"{t['host_evicted_tokens']:,}"),
        ("policy / load-back threshold", f"{t['write_policy']} / {t['load_back_threshold']} tokens"),
    ]


def _pct(value: float) -> str:
    return f"{value * 100:.2f}%"
