"""`--plot FILE.png` of a study: hit rate against the swept key, or by tier for hiradix points
(matplotlib, optional: `memcli.tools.replay.plot.require_matplotlib`)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

from memcli.tools.replay.plot import require_matplotlib
from memcli.tools.study.grid import point_label


class StudyLine(NamedTuple):
    label: str
    xs: list
    ys: list[float]
    bound: bool  # Belady's offline bound: drawn dashed


def study_lines(doc: dict) -> tuple[Optional[str], list, list[StudyLine], list[tuple[int, float]]]:
    """What a study's plot draws: the x key (the first swept key whose values are all numbers,
    else the first key), its values in order, one line per combination of the other keys,
    and the ceiling of each page size."""
    keys, points = doc["study"]["keys"], doc["points"]
    x_key = next((k for k in keys if all(_is_number(p["config"][k]) for p in points)), keys[0] if keys else None)
    numeric = x_key is not None and all(_is_number(p["config"][x_key]) for p in points)
    values = sorted({p["config"][x_key] for p in points}, key=lambda v: v if numeric else str(v)) if x_key else [0]
    position = {v: (v if numeric else i) for i, v in enumerate(values)}
    others = [k for k in keys if k != x_key]
    groups: dict[tuple, list] = {}
    for p in points:
        groups.setdefault(tuple(p["config"][k] for k in others), []).append(p)
    lines = []
    for combo, members in groups.items():
        members.sort(key=lambda p: position[p["config"][x_key]] if x_key else 0)
        label = ", ".join(f"{k.split('.', 1)[-1]}={v}" for k, v in zip(others, combo)) or "hit rate"
        bound = all(p["eviction_policy"] == "belady" for p in members)
        lines.append(StudyLine(label + (" (offline bound)" if bound else ""),
                               [position[p["config"][x_key]] if x_key else 0 for p in members],
                               [p["hit_rate"] for p in members], bound))
    ceilings = sorted({(p["page_size"], p["ceiling_hit_rate"]) for p in points})
    return x_key, values if not numeric else [], lines, ceilings


def plot_study(doc: dict, path: Path) -> None:
    """Hit rate against the swept key, one line per combination of the other keys (Belady's
    dashed), the never-evicting ceiling of each page size dotted, the replayed unlimited pool
    dashed grey."""
    plt = require_matplotlib()
    if doc["points"] and all("tier_device_hit" in p for p in doc["points"]):
        _plot_tiers(plt, doc, path)
        return
    x_key, categories, lines, ceilings = study_lines(doc)
    fig, ax = plt.subplots(figsize=(9, 5))
    top = 0.0
    for line in lines:
        ax.plot(line.xs, line.ys, marker="o", ls="--" if line.bound else "-", label=line.label)
        top = max(top, *line.ys)
    for ps, ceiling in ceilings:
        ax.axhline(ceiling, color="black", ls=":", lw=1, label=f"ceiling, page size {ps} (never evicting)")
        top = max(top, ceiling)
    for ref in doc["references"]:
        if ref["method"] == "replayed":
            ax.axhline(ref["hit_rate"], color="grey", ls="--", lw=0.8, label=f"unlimited pool, page size {ref['page_size']}")
            top = max(top, ref["hit_rate"])
    ax.set_ylim(0, max(top * 1.15, 0.01))
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    if not categories:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v == int(v) else f"{v:,}"))
    if categories:
        ax.set_xticks(list(range(len(categories))), [str(v) for v in categories])
    ax.set_xlabel(x_key or "point")
    ax.set_ylabel("hit rate (cached / prompt tokens)")
    ax.set_title(f"hit rate against {x_key}" if x_key else "hit rate")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


TIERS = (("tier_device_hit", "device hit"), ("tier_host_loaded", "host hit, loaded back"),
         ("tier_host_skipped", "host hit, skipped (recomputed)"))


def _plot_tiers(plt, doc: dict, path: Path) -> None:
    """Stacked bars: the hit rate by tier of every point (a host size, a write policy), and
    the unlimited-pool references."""
    points = doc["points"]
    labels = [point_label(p["point"]) for p in points]
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(labels)), 4.5))
    bottom = np.zeros(len(x))
    for key, label in TIERS:
        values = np.array([p[key] for p in points])
        ax.bar(x, values, bottom=bottom, label=label, width=0.6)
        bottom += values
    top = float(bottom.max()) if len(bottom) else 0.0
    for ref in doc["references"]:
        ax.axhline(ref["hit_rate"], color="grey", ls="--", label=f"unlimited, page size {ref['page_size']} ({ref['method']})")
        top = max(top, ref["hit_rate"])
    ax.set_ylim(0, top * 1.15 + 1e-3)
    ax.set_xticks(x, labels, rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("share of prompt tokens")
    ax.set_title("hit rate by tier (hiradix)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
