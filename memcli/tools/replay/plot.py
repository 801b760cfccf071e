"""`--plot FILE.png`: occupancy and running requests over simulated time, or a study's hit rates
(matplotlib, optional). The command prints each plot's path on stderr.

matplotlib is the optional extra `plot` (`pip install 'memcli[plot]'`); without it,
`require_matplotlib` raises a `MemcliError` before the replay starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

from memcli.errors import MemcliError
from memcli.tools.replay.result import ReplayResult

MAX_POINTS = 20_000


def require_matplotlib():
    """The pyplot module on a headless backend; `MemcliError` with an install hint without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MemcliError("--plot needs matplotlib, which is not installed",
                          "pip install 'memcli[plot]' (or pip install matplotlib), or leave out --plot") from None
    return plt


def check_plot_path(path: Path) -> None:
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise MemcliError(f"--plot {path}: unsupported file type {path.suffix or '(none)'}",
                          "name the file .png, .svg or .pdf")
    if not path.parent.exists():
        raise MemcliError(f"--plot {path}: folder {path.parent} does not exist", "create it or choose another path")


def _thin(series: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    n = len(series["time_ms"])
    if n <= MAX_POINTS:
        return series
    index = np.linspace(0, n - 1, MAX_POINTS).round().astype(np.int64)
    return {name: values[index] for name, values in series.items()}


def occupancy_scale(series: dict[str, np.ndarray], pool_tokens: int, page_size: int) -> tuple[float, bool]:
    """The occupancy panel's y-axis top, scaled to the most the replay used (15 % headroom,
    at most a little over the pool), and whether the pool line is on that scale."""
    used = 0
    if len(series["time_ms"]):
        used = max(int(series["used_pages"].max()) * page_size, int(series["used_tokens"].max()))
    top = min(max(used * 1.15, page_size), pool_tokens * 1.05)
    return top, pool_tokens <= top


def plot_replay(result: ReplayResult, path: Path) -> None:
    """Top: pool occupancy in tokens (used, as pages, evictable, protected); bottom: running
    and waiting requests. x: simulated seconds."""
    plt = require_matplotlib()
    s = _thin(result.series)
    t = s["time_ms"] / 1e3
    ps = result.config.page_size
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    top.plot(t, s["used_tokens"], label="used (tokens)", lw=1)
    top.plot(t, s["used_pages"] * ps, label=f"used (pages x {ps})", lw=1)
    top.plot(t, s["evictable"], label="evictable (tree, unlocked)", lw=1)
    top.plot(t, s["protected"], label="protected (tree, locked)", lw=1)
    pool = result.occupancy.pool_tokens
    y_top, pool_shown = occupancy_scale(result.series, pool, ps)
    if pool_shown:
        top.axhline(pool, color="grey", ls="--", lw=0.8, label="pool")
    else:  # the pool is far above what was used: scaled to the use, the pool named in the legend
        top.plot([], [], color="grey", ls="--", lw=0.8, label=f"pool {pool:,} tokens (above the scale)")
    top.set_ylim(0, y_top)
    top.set_ylabel("tokens")
    top.legend(loc="upper left", fontsize=8)
    top.set_title(f"replay of {Path(result.trace.path).name}: {result.arrivals} arrivals,"
                  f" hit rate {result.prefix.hit_rate:.1%}")
    bottom.plot(t, s["running"], label="running", lw=1)
    bottom.plot(t, s["waiting"], label="waiting", lw=1)
    bottom.set_ylabel("requests")
    bottom.set_xlabel("simulated time (s)")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    from memcli.tools.replay.grid import point_label

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
