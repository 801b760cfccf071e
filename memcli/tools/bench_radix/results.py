"""What `bench-radix` measured: both trees' median replay times and what each matched and evicted."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRadixResult:
    """Median seconds of match + insert + evict over all requests, per implementation."""

    trace: str
    num_requests: int
    page_size: int
    capacity_tokens: int
    block_size: int
    prompt_tokens: int
    matched_tokens: int
    baseline_matched_tokens: int
    mismatched_requests: int
    evicted_tokens: int
    baseline_evicted_tokens: int
    radix_s: float
    baseline_s: float
    radix_runs_s: tuple[float, ...]
    baseline_runs_s: tuple[float, ...]
    torch_threads: int

    @property
    def speedup(self) -> float:
        """Baseline time / radix time."""
        return self.baseline_s / self.radix_s if self.radix_s > 0 else float("inf")

    @property
    def hit_rate(self) -> float:
        """Matched prompt tokens / prompt tokens (full-prompt match, page-floored, cold start)."""
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "speedup": self.speedup, "hit_rate": self.hit_rate,
                "same_matches": self.mismatched_requests == 0}
