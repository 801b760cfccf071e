"""`memcli replay` results as one JSON document or rich tables (readable without colour)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from memcli.mem_cache.integrity import page_label, story
from memcli.tools.replay.host_tier import TIER_DEFINITION, tier_rows
from memcli.tools.replay.metrics import (DEFINITIONS, EVICTION_DEFINITIONS, VLLM_WINDOW_REQUESTS, WINDOW_REQUESTS,
                                         downsample)
from memcli.tools.replay.results import ReplayOutcome, ReplayResult
from memcli.report.envelope import envelope
from memcli.report.tables import fmt, kv_table

SERIES_POINTS = 500


def _round(value: float, digits: int = 6) -> float:
    return round(float(value), digits)


def replay_document(result: ReplayResult, series_points: int = SERIES_POINTS,
                    bound: Optional[ReplayResult] = None) -> dict[str, Any]:
    """The JSON document of one replay (headline fields first, then one object per section).
    `bound`: the Belady replay of `--bound belady`."""
    s, p, o, a, e, q, i = (result.summary, result.prefix, result.occupancy, result.allocation, result.eviction,
                           result.scheduling, result.integrity)
    return envelope("replay", {
        "interrupted": result.interrupted,
        "stalled": result.stop.message if result.stop is not None and result.stop.reason == "stalled" else None,
        "requests": s.requests,
        "input_tokens": p.input_tokens,
        "output_tokens": s.output_tokens,
        "cached_tokens": p.cached_tokens,
        "hit_rate": _round(p.hit_rate),
        "page_size": result.config.page_size,
        "event_loop": result.config.behaviour.event_loop,
        "arrivals": result.arrivals,
        "device": result.device,
        "kernel_backend": result.kernel_backend,
        "trace": dataclasses.asdict(result.trace),
        "summary": {
            "requests": s.requests, "finished": s.finished, "aborted": s.aborted,
            "input_tokens": result.trace.input_tokens, "output_tokens": s.output_tokens,
            "simulated_time_ms": _round(s.simulated_ms, 3), "steps": s.steps, "prefill_steps": s.prefill_steps,
            "decode_steps": s.decode_steps, "idle_steps": s.idle_steps, "wall_time_s": _round(s.wall_s, 3),
            "steps_per_s": _round(s.steps_per_s, 1),
            "queueing_delay_ms": result.queueing_delay.to_dict() if result.queueing_delay else None,
        },
        "prefix_cache": _prefix_section(p, bound),
        "allocation": _allocation_section(o, a),
        "eviction": {**dataclasses.asdict(e), "needed_again_share": _round(e.needed_again_share),
                     "definitions": EVICTION_DEFINITIONS},
        "scheduling": {
            "retractions": q.retractions, "retracted_requests": q.retracted_requests,
            "recomputed_tokens": q.recomputed_tokens, "aborted": q.aborted, **dataclasses.asdict(q.queue),
        },
        **({"limits": result.limits.to_dict()} if result.limits else {}),
        "integrity": _integrity_section(i),
        "series": {"points": series_points, **downsample(_series_fields(result), series_points)},
        **({"host_tier": result.host_tier.to_dict()} if result.host_tier is not None else {}),
    }, result.config)


def _vllm_reported_section(v) -> dict[str, Any]:
    """vLLM's own counters (`memcli.steps.VllmReported`): the per-run rate and the logged window."""
    return {
        "per_run": {"requests": v.requests, "queries": v.queries, "hits": v.hits,
                    "hit_rate": _round(v.per_run_hit_rate)},
        "preempted": {"requests": v.preempted_requests, "queries": v.preempted_queries,
                      "hits": v.preempted_hits, "hit_rate": _round(v.preempted_hit_rate)},
        "logged_window": {"max_recent_requests": VLLM_WINDOW_REQUESTS, "requests": v.window_requests,
                          "queries": v.window_queries, "hits": v.window_hits,
                          "hit_rate": _round(v.window_hit_rate)},
        "definition": DEFINITIONS["vllm_reported"],
    }


def _vllm_reported_rows(v) -> list:
    if v is None:
        return []
    return [
        ("vLLM's counters, per run (memcli)", f"{_pct(v.per_run_hit_rate)} ({v.hits:,} / {v.queries:,},"
                                               f" {v.requests:,} requests)"),
        ("vLLM's counters, preempted apart", f"{_pct(v.preempted_hit_rate)} ({v.preempted_hits:,} /"
                                              f" {v.preempted_queries:,}, {v.preempted_requests:,} requests)"),
        (f"vLLM's logged hit rate (last {VLLM_WINDOW_REQUESTS:,} requests)",
         f"{_pct(v.window_hit_rate)} ({v.window_hits:,} / {v.window_queries:,}, {v.window_requests:,} requests)"),
    ]


def _prefix_section(p, bound: Optional[ReplayResult]) -> dict[str, Any]:
    """The prefix cache's hit rates, each with its definition (`metrics.DEFINITIONS`)."""
    return {
        "requests": p.requests,
        "cached_tokens": p.cached_tokens,
        "input_tokens": p.input_tokens,
        "hit_rate": _round(p.hit_rate),
        "hit_rate_definition": DEFINITIONS["hit_rate"],
        "block_ratio": {"hit_blocks": p.hit_blocks, "blocks": p.blocks, "block_size": p.block_size,
                        "value": _round(p.block_ratio), "definition": DEFINITIONS["block_ratio"]},
        "warmup_excluded": {"cached_tokens": p.warmup_cached_tokens, "input_tokens": p.warmup_input_tokens,
                            "hit_rate": _round(p.warmup_excluded_hit_rate),
                            "definition": DEFINITIONS["warmup_excluded"]},
        "last_1000": {"n": WINDOW_REQUESTS, "cached_tokens": p.window_cached_tokens,
                      "input_tokens": p.window_input_tokens, "hit_rate": _round(p.last_1000_hit_rate),
                      "definition": DEFINITIONS["last_1000"]},
        "per_request_mean": {"requests": p.requests, "hit_rate": _round(p.per_request_mean_hit_rate),
                             "definition": DEFINITIONS["per_request_mean"]},
        "page_hit_rate": {"hit_pages": p.hit_pages, "pages": p.pages, "page_size": p.page_size,
                          "value": _round(p.page_hit_rate), "definition": DEFINITIONS["page_hit_rate"]},
        "sglang_batch": {"batches": p.batches, "mean": _round(p.batch_mean_hit_rate),
                         "last": _round(p.last_batch_hit_rate), "definition": DEFINITIONS["sglang_batch"]},
        "sglang_cumulative": {"cached_tokens": p.batch_cached_tokens, "new_tokens": p.batch_new_tokens,
                              "hit_rate": _round(p.sglang_cumulative_hit_rate),
                              "definition": DEFINITIONS["sglang_cumulative"]},
        "vllm": {"queries": p.vllm_queries, "hits": p.vllm_hits, "hit_rate": _round(p.vllm_hit_rate),
                 "definition": DEFINITIONS["vllm"]},
        **({"vllm_reported": _vllm_reported_section(p.vllm_reported)} if p.vllm_reported is not None else {}),
        "belady": None if bound is None else {
            "cached_tokens": bound.prefix.cached_tokens, "hit_rate": _round(bound.prefix.hit_rate),
            "evictions": bound.eviction.evictions, "wall_time_s": _round(bound.summary.wall_s, 3),
            "definition": DEFINITIONS["belady"]},
        "ceiling": {"tokens": p.ceiling_tokens, "hit_rate": _round(p.ceiling_hit_rate),
                    "page_size_1_tokens": p.shared_tokens, "definition": DEFINITIONS["ceiling"]},
        "lost_to_page_alignment": {"tokens": p.lost_to_page_alignment,
                                   "definition": DEFINITIONS["lost_to_page_alignment"]},
        "sub_page_prefix_requests": {"requests": p.sub_page_prefix_requests,
                                     "definition": DEFINITIONS["sub_page_prefix_requests"]},
        "lost_to_capacity_and_timing": {"tokens": p.lost_to_capacity_and_timing,
                                        "definition": DEFINITIONS["lost_to_capacity_and_timing"]},
        "requests_with_hits": p.requests_with_hits,
    
    }


def _allocation_section(o, a) -> dict[str, Any]:
    """Pool occupancy (means weighted by simulated time) and allocator traffic."""
    return {
        "pool_tokens": o.pool_tokens, "num_pages": o.num_pages,
        "peak_used_tokens": o.peak_used_tokens, "mean_used_tokens": _round(o.mean_used_tokens, 1),
        "peak_used_pages": o.peak_used_pages, "mean_used_pages": _round(o.mean_used_pages, 1),
        "peak_partial_page_waste_tokens": o.peak_waste_tokens,
        "mean_partial_page_waste_tokens": _round(o.mean_waste_tokens, 1),
        "peak_evictable_tokens": o.peak_evictable_tokens, "peak_protected_tokens": o.peak_protected_tokens,
        "allocations": a.allocations, "allocated_tokens": a.allocated_tokens, "frees": a.frees,
        "freed_tokens": a.freed_tokens, "peak_request_rows": a.peak_request_rows, "request_rows": a.request_rows,
        "oom_events": a.oom_events,
        "means": "weighted by simulated time",
    
    }


def _integrity_section(i) -> dict[str, Any]:
    """The integrity checks: how they ran, the first failure (with the history of its pages,
    when there is one), the pool at the end."""
    history = {"history": [touch.to_dict() for touch in i.history]} if i.history else {}
    return {
        "ok": i.ok, "mode": i.mode, "checks_run": i.checks_run, "failure": i.failure,
        "failure_step": i.failure_step, "failure_check": i.failure_check, **history,
        "incremental_checks": i.incremental_checks, "full_walks": i.full_walks, "check_s": _round(i.check_s, 3),
        "everything_free_at_end": i.everything_free,
        "end": {"available": i.end_available, "evictable": i.end_evictable, "protected": i.end_protected,
                "rows_in_use": i.end_rows_in_use},
        "final_reports": list(i.final_reports),
    
    }


def outcome_document(outcome: ReplayOutcome) -> dict[str, Any]:
    """The document `memcli replay --json` prints: the replay's, with the ignored config keys."""
    return {**replay_document(outcome.result, bound=outcome.bound), "ignored_keys": list(outcome.ignored_keys)}


def render_outcome(outcome: ReplayOutcome, console: Console) -> None:
    """The tables `memcli replay` prints (the bound beside the replay, when asked for)."""
    render_replay(outcome.result, console, bound=outcome.bound)


def _series_fields(result: ReplayResult) -> dict:
    keep = ("time_ms", "running", "waiting", "used_tokens", "used_pages", "evictable", "protected", "waste_tokens")
    if result.host_tier is not None:
        keep += ("host_used", "d2h_bytes", "h2d_bytes")
    return {name: result.series[name] for name in keep}


def render_replay(result: ReplayResult, console: Console, bound: Optional[ReplayResult] = None) -> None:
    for table in replay_tables(result, bound):
        console.print(table)
    p = result.prefix
    for label, name in footnotes(result, bound):
        console.print(f"{label} = {DEFINITIONS[name]}.")
    if result.eviction.future_known and result.eviction.evictions:
        console.print(f"reuse distance = {EVICTION_DEFINITIONS['reuse_distance']}.")
    if p.sub_page_prefix_requests:
        console.print(f"{p.sub_page_prefix_requests} request(s) shared a prefix shorter than one page"
                      f" ({p.page_size} tokens): they can never hit.")
    if result.host_tier is not None:
        console.print(f"host tier = {TIER_DEFINITION}.")
    for line in limit_lines(result.limits):
        console.print(line, markup=False, highlight=False)
    if result.integrity.failure:
        console.print(f"INTEGRITY FAILURE (replay stopped): {result.integrity.failure}", markup=False)
        for line in history_lines(result.integrity, result.config.page_size):
            console.print(line, markup=False, highlight=False)
    if result.stop is not None:
        console.print(f"STOPPED EARLY ({result.stop.reason}): {result.stop.message}")


def _limit_rows(cuts) -> list[tuple[str, Any]]:
    if not cuts:
        return []
    return [("aborted by the engine's limits", len(cuts.aborted)),
            ("outputs clipped by the engine's limits", len(cuts.clipped))]


def limit_lines(cuts, shown: int = 20) -> list[str]:
    """The requests the engine's limits cut, one line per kind (the first `shown` of each)."""
    lines = []
    for kind, group in (("aborted at arrival", cuts.aborted), ("output clipped", cuts.clipped)):
        if group:
            names = ", ".join(cut.label() for cut in group[:shown])
            more = f" and {len(group) - shown} more (--json lists them all)" if len(group) > shown else ""
            lines.append(f"{kind}: {names}{more}")
    return [f"engine limits: {cuts.rule}.", *lines] if lines else []


def history_lines(i, page_size: int) -> list[str]:
    """The failure's story, page after page (or how to get one)."""
    if not i.history:
        return [] if i.mode == "every step" else ["(replay with --check for the history of the pages involved)"]
    return story(list(i.history), label=lambda page: page_label(page, page_size)).splitlines()


def footnotes(result: ReplayResult, bound: Optional[ReplayResult] = None) -> list[tuple[str, str]]:
    """(label, DEFINITIONS key) of every figure in the tables that needs its definition: each
    hit rate, the ceiling, the Belady bound when there is one, and each "lost" or "waste"
    figure shown."""
    paged = result.prefix.page_size > 1
    return [("hit rate", "hit_rate"), ("per-request mean", "per_request_mean"), ("page hit rate", "page_hit_rate"),
            ("block ratio", "block_ratio"), ("SGLang per batch", "sglang_batch"),
            ("SGLang cumulative", "sglang_cumulative"), ("vLLM", "vllm"),
            *([("vLLM's counters", "vllm_reported")] if result.prefix.vllm_reported is not None else []),
            ("first 50% excluded", "warmup_excluded"),
            *([(f"last {WINDOW_REQUESTS:,} requests", "last_1000")] if result.trace.requests > WINDOW_REQUESTS else []),
            ("ceiling", "ceiling"), *([("Belady bound", "belady")] if bound is not None else []),
            ("lost to capacity and timing", "lost_to_capacity_and_timing"),
            *([("lost to page alignment", "lost_to_page_alignment"),
               ("partial-page waste", "partial_page_waste")] if paged else []),
            ("returned to the free list", "returned_to_free_list"),
            ("no request holds memory at the end", "no_request_holds_memory")]


def replay_tables(result: ReplayResult, bound: Optional[ReplayResult] = None) -> list[Table]:
    s, p, o, a, e, q, i = (result.summary, result.prefix, result.occupancy, result.allocation, result.eviction,
                           result.scheduling, result.integrity)
    ps = p.page_size
    paged = ps > 1  # page alignment and partial pages cost nothing at page size 1
    summary = kv_table("summary", [
        ("trace", f"{result.trace.path} ({result.trace.format})"),
        ("arrivals", result.arrivals),
        ("semantics (profile)", result.config.semantics.label),
        ("scheduler loop", result.config.behaviour.event_loop),
        ("device / kernels", f"{result.device} / {result.kernel_backend}"),
        ("requests", s.requests), ("finished", s.finished), ("aborted", s.aborted),
        ("input tokens", result.trace.input_tokens), ("output tokens", s.output_tokens),
        ("simulated time (s)", s.simulated_ms / 1e3),
        ("steps (prefill / decode / idle)", f"{s.steps:,} ({s.prefill_steps:,} / {s.decode_steps:,} / {s.idle_steps:,})"),
        *_delay_row(result.queueing_delay),
        ("wall time (s)", s.wall_s), ("steps per second", s.steps_per_s),
    ])
    prefix = _prefix_table(result, bound)
    allocation = _allocation_table(o, a, paged)
    reuse = [
        ("needed again (tokens, share)", f"{e.tokens_needed_again:,} ({_pct(e.needed_again_share)})"),
        ("reuse distance p50 / p90 / max (requests)", _dist(e.reuse_distance_requests, 1)),
        ("reuse distance p50 / p90 / max (s)", _dist(e.reuse_distance_ms, 1e-3)),
    ] if e.future_known else [("reuse distance", f"not computed ({e.future_missing or 'the trace is not known ahead'})")]
    eviction = kv_table(f"eviction (policy {e.policy})", [
        ("evictions (nodes)", e.evictions), ("tokens evicted", e.tokens_evicted),
        *([("age at eviction p50 / p90 / max (s)", _dist(e.age_ms, 1e-3)),
           ("hits before eviction p50 / p90 / max", _dist(e.hits_before_eviction, 1)), *reuse] if e.evictions else []),
    ])
    scheduling = kv_table("scheduling", [
        ("retraction events (requests retracted)", f"{q.retractions:,} ({q.retracted_requests:,})"),
        ("recomputed tokens", q.recomputed_tokens), ("aborted", q.aborted),
        *_limit_rows(result.limits),
        ("running, mean / max", f"{q.queue.mean_running:,.1f} / {q.queue.max_running:,}"),
        ("waiting, mean / max", f"{q.queue.mean_waiting:,.1f} / {q.queue.max_waiting:,}"),
    ])
    integrity = kv_table("integrity", [
        ("checks", i.mode), ("checks run", i.checks_run),
        ("incremental / full walks", f"{i.incremental_checks:,} / {i.full_walks:,} ({i.check_s:,.2f} s)"),
        ("result", "ok" if i.ok else "FAILED"),
        ("no request holds memory at the end", i.everything_free),
    ])
    tables = [summary, prefix, allocation, eviction, scheduling, integrity]
    if result.host_tier is not None:
        tables.insert(2, kv_table(f"host tier (hiradix, host pool {result.host_tier.host_pool_tokens:,} tokens)",
                                  tier_rows(result.host_tier)))
    return tables


def _prefix_table(result: ReplayResult, bound: Optional[ReplayResult]) -> Table:
    p = result.prefix
    ps = p.page_size
    paged = ps > 1
    return kv_table(f"prefix cache (page size {ps}, block size {p.block_size})", [
        ("cached tokens", p.cached_tokens), ("input tokens", p.input_tokens),
        ("hit rate (tokens)", _pct(p.hit_rate)),
        ("per-request mean", _pct(p.per_request_mean_hit_rate)),
        ("page hit rate (hit pages / pages)", f"{_pct(p.page_hit_rate)} ({p.hit_pages:,} / {p.pages:,})"),
        ("block ratio (hit blocks / blocks)", f"{_pct(p.block_ratio)} ({p.hit_blocks:,} / {p.blocks:,})"),
        ("SGLang per batch, mean / last", f"{_pct(p.batch_mean_hit_rate)} / {_pct(p.last_batch_hit_rate)}"
                                          f" ({p.batches:,} batches)"),
        ("SGLang cumulative", _pct(p.sglang_cumulative_hit_rate)),
        ("vLLM (hits / queries)", f"{_pct(p.vllm_hit_rate)} ({p.vllm_hits:,} / {p.vllm_queries:,})"),
        *_vllm_reported_rows(p.vllm_reported),
        ("hit rate, first 50% excluded", _pct(p.warmup_excluded_hit_rate)),
        # over a trace of at most WINDOW_REQUESTS the window is the whole trace: the hit rate above
        *([(f"hit rate, last {WINDOW_REQUESTS:,} requests", _pct(p.last_1000_hit_rate))]
          if result.trace.requests > WINDOW_REQUESTS else []),
        ("ceiling (sequential, never evicting)", f"{_pct(p.ceiling_hit_rate)} ({p.ceiling_tokens:,} tokens)"),
        *([("Belady bound (offline, same pool)", _pct(bound.prefix.hit_rate))] if bound is not None else []),
        ("lost to capacity and timing", p.lost_to_capacity_and_timing),
        *([("lost to page alignment", p.lost_to_page_alignment),
           ("requests with a sub-page shared prefix", p.sub_page_prefix_requests)] if paged else []),
        ("requests with a hit", p.requests_with_hits),
    ])


def _allocation_table(o, a, paged: bool) -> Table:
    return kv_table(f"allocation (pool {o.pool_tokens:,} tokens = {o.num_pages:,} pages)", [
        ("peak used tokens", f"{o.peak_used_tokens:,} ({_pct(o.peak_token_fraction)})"),
        *([("peak used pages", f"{o.peak_used_pages:,} ({_pct(o.peak_page_fraction)})"),
           ("mean used tokens / pages", f"{o.mean_used_tokens:,.0f} / {o.mean_used_pages:,.0f}")] if paged else
          [("mean used tokens", f"{o.mean_used_tokens:,.0f}")]),
        *([("partial-page waste, peak / mean (tokens)", f"{o.peak_waste_tokens:,} / {o.mean_waste_tokens:,.0f}")]
          if paged else []),
        ("peak evictable / protected (tokens)", f"{o.peak_evictable_tokens:,} / {o.peak_protected_tokens:,}"),
        ("allocations (tokens)", f"{a.allocations:,} ({a.allocated_tokens:,})"),
        ("returned to the free list: calls (tokens)", f"{a.frees:,} ({a.freed_tokens:,})"),
        ("request rows, peak / total", f"{a.peak_request_rows:,} / {a.request_rows:,}"),
        ("out-of-memory events", a.oom_events),
    ])


def _delay_row(delay) -> list[tuple[str, str]]:
    if delay is None or not delay.requests:
        return []
    return [("queueing delay p50 / p90 / p99 / max (ms)",
             " / ".join(fmt(round(v, 1)) for v in (delay.p50, delay.p90, delay.p99, delay.max)))]


def _pct(value: float) -> str:
    return f"{value * 100:.2f}%"


def _dist(values: dict[str, float], scale: float) -> str:
    return " / ".join(fmt(round(values[k] * scale, 3)) for k in ("p50", "p90", "max"))
