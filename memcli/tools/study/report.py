"""A study as one table (a row per finished point, then the unlimited-pool references).

Its JSON document is `files.study_document` (the same one `--out DIR` writes as study.json).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from memcli.report.tables import fmt
from memcli.tools.replay.metrics import DEFINITIONS
from memcli.tools.study.grid import point_label, short_key


def render_study(doc: dict[str, Any], console: Console) -> None:
    """The study as one table: a row per finished point (its keys, then the numbers), then the
    unlimited-pool reference of each page size."""
    keys = doc["study"]["keys"]
    names = [short_key(key, keys) for key in keys]
    table = Table(title=f"study of {', '.join(names) or 'the base config'}: {doc['study']['finished']} of"
                        f" {doc['study']['points']} points ({doc['arrivals']} arrivals, {doc['study']['executor']})",
                  title_justify="left")
    for name in [*names, "pool", "hit rate", "ceiling", "evictions", "needed again", "retracts"]:
        table.add_column(name, justify="left" if name in names else "right", no_wrap=True)
    for entry in doc["points"]:
        table.add_row(*(_value(entry["config"][key]) for key in keys), fmt(entry["pool_tokens"]),
                      _pct(entry["hit_rate"]), _pct(entry["ceiling_hit_rate"]), fmt(entry["evictions"]),
                      _optional_pct(entry["needed_again_share"]), fmt(entry["retractions"]))
    for ref in doc["references"]:
        label = [f"unlimited, ps {ref['page_size']}"] + [""] * (len(keys) - 1) if keys else []
        table.add_row(*label, fmt(ref["pool_tokens"]) if ref["pool_tokens"] else "-", _pct(ref["hit_rate"]),
                      _pct(ref["ceiling_hit_rate"]), "-", "-", "-")
    console.print(table)
    tiers = [entry for entry in doc["points"] if "tier_device_hit" in entry]
    if tiers:
        console.print(_tier_table(tiers, keys))
    by_index = {entry["index"]: entry for entry in doc["points"]}
    for entry in doc["points"]:
        if not entry["integrity_ok"]:
            console.print(f"INTEGRITY FAILURE at {point_label(entry['point'])} (that replay stopped)")
        if entry["stalled"]:
            console.print(f"STALLED at {point_label(entry['point'])} (that replay stopped)")
        if entry.get("same_as") is not None:  # the rule is the engine's (`Engine.eviction_order`)
            twin = by_index[entry["same_as"]]
            console.print(f"{point_label(entry['point'])}: the replay of point {entry['same_as']} (this engine's tree"
                          f" evicts {entry['eviction_policy']} in {twin['eviction_policy']}'s order)", markup=False,
                          highlight=False)
        if entry.get("limit_cut_requests"):
            console.print(f"engine limits at {point_label(entry['point'])}: {entry['limit_aborted']} aborted at"
                          f" arrival, {entry['limit_clipped']} outputs clipped: {entry['limit_cut_requests']}",
                          markup=False, highlight=False)
    console.print("ceiling = sequential, never evicting; needed again = share of evicted tokens a later request"
                  " uses (see the single-replay report); --out DIR (study.csv) and --json have every number of"
                  " every point, every hit-rate definition included.")
    if tiers:
        console.print("host tier: hit rate by tier (device, host loaded back, host skipped, miss; see the"
                      " single-replay report), GB copied device -> host and back, host tokens evicted.")
    console.print(f"hit rate = {DEFINITIONS['hit_rate']}.")
    for ref in doc["references"]:
        console.print(f"unlimited, ps {ref['page_size']} ({ref['method']}): {ref['note']}.")


def _tier_table(entries: list[dict[str, Any]], keys: list[str]) -> Table:
    """Hit rate by tier per point (the points with a host tier)."""
    table = Table(title=f"host tier by {', '.join(keys)}", title_justify="left")
    for name in ("point", "host pool", "device", "host load", "host skip", "miss", "GB d2h", "GB h2d",
                 "host evict", "sim s"):
        table.add_column(name, justify="left" if name == "point" else "right", no_wrap=True)
    for e in entries:
        table.add_row(point_label(e["point"]), fmt(e["host_pool_tokens"]), _pct(e["tier_device_hit"]),
                      _pct(e["tier_host_loaded"]), _pct(e["tier_host_skipped"]), _pct(e["tier_miss"]),
                      f"{e['d2h_bytes'] / 1e9:,.1f}", f"{e['h2d_bytes'] / 1e9:,.1f}", fmt(e["host_evicted_tokens"]),
                      f"{e['simulated_time_ms'] / 1e3:,.0f}")
    return table


def _value(value: Any) -> str:
    return fmt(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _pct(value: float) -> str:
    return f"{value * 100:.2f}%"


def _optional_pct(value) -> str:
    return "-" if value is None else _pct(value)
