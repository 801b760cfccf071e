"""What a study records: one flat row of numbers per point (`point_row`, the CSV's columns),
and the outcome of a whole study (`StudyOutcome`: its document, or where Ctrl-C stopped it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from memcli.tools.replay.results import ReplayResult


@dataclass(frozen=True)
class StudyOutcome:
    """`document`: the study (`files.study_document`, what `--json` prints and `--out` writes);
    None when Ctrl-C stopped it, then `interrupted` is the line saying how far it got.
    `plot`: the path written by `--plot`, if any."""

    document: Optional[dict[str, Any]]
    interrupted: Optional[str] = None
    plot: Optional[Any] = None

    @property
    def failed(self) -> bool:
        """A point's integrity check failed or its replay stalled."""
        points = self.document["points"] if self.document is not None else []
        return any(not entry["integrity_ok"] or entry["stalled"] for entry in points)


def point_row(r: ReplayResult) -> dict[str, Any]:
    """The numbers of one point: a flat mapping of JSON values (the CSV's columns)."""
    p, e = r.prefix, r.eviction
    return {
        "requests": r.summary.requests, "input_tokens": p.input_tokens, "output_tokens": r.summary.output_tokens,
        "cached_tokens": p.cached_tokens, "hit_rate": _round(p.hit_rate),
        "per_request_mean_hit_rate": _round(p.per_request_mean_hit_rate), "page_hit_rate": _round(p.page_hit_rate),
        "block_ratio": _round(p.block_ratio), "sglang_batch_mean_hit_rate": _round(p.batch_mean_hit_rate),
        "sglang_cumulative_hit_rate": _round(p.sglang_cumulative_hit_rate), "vllm_hit_rate": _round(p.vllm_hit_rate),
        "warmup_excluded_hit_rate": _round(p.warmup_excluded_hit_rate),
        "last_1000_hit_rate": _round(p.last_1000_hit_rate),
        "ceiling_hit_rate": _round(p.ceiling_hit_rate), "page_size": r.config.page_size,
        "eviction_policy": r.config.cache.eviction_policy,
        "pool_tokens": r.occupancy.pool_tokens, "evictions": e.evictions,
        "tokens_evicted": e.tokens_evicted,
        "needed_again_share": _round(e.needed_again_share) if e.future_known else None,
        "reuse_distance_requests_p50": e.reuse_distance_requests["p50"] if e.future_known else None,
        "retractions": r.scheduling.retractions,
        "peak_used_tokens": r.occupancy.peak_used_tokens, "simulated_time_ms": _round(r.summary.simulated_ms, 3),
        "steps": r.summary.steps, "wall_time_s": _round(r.summary.wall_s, 3), "integrity_ok": r.integrity.ok,
        "stalled": r.stop is not None and r.stop.reason == "stalled",
        **(_tier_columns(r) if r.host_tier is not None else {}),
        **(_limit_columns(r) if r.limits else {}),
    }


def _limit_columns(r: ReplayResult) -> dict[str, Any]:
    """The requests the engine's limits cut at this point: counts, and each named with its line."""
    cuts = r.limits
    return {"limit_aborted": len(cuts.aborted), "limit_clipped": len(cuts.clipped),
            "limit_cut_requests": "; ".join(f"{cut.label()} {cut.action}" for cut in cuts.requests)}


def _tier_columns(r: ReplayResult) -> dict[str, Any]:
    """The host tier of a hiradix point, flat: hit rate by tier, the host pool, the copies."""
    h = r.host_tier
    return {**{f"tier_{key}": _round(value) for key, value in h.rates.items()},
            "host_pool_tokens": h.host_pool_tokens, "d2h_bytes": h.transfers["d2h_bytes"],
            "h2d_bytes": h.transfers["h2d_bytes"], "host_evicted_tokens": h.transfers["host_evicted_tokens"]}


# Columns that depend on the machine, not on the replay: left out when results are compared.
TIMING_COLUMNS = ("wall_time_s",)


def _round(value: float, digits: int = 6) -> float:
    return round(float(value), digits)
