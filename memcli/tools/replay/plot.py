"""`--plot FILE.png`: occupancy and running requests over simulated time (matplotlib, optional).

matplotlib is the optional extra `plot` (`pip install 'memcli[plot]'`); without it,
`require_matplotlib` raises a `MemcliError` before the replay starts.
"""

from __future__ import annotations

from pathlib import Path

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
    top.axhline(result.occupancy.pool_tokens, color="grey", ls="--", lw=0.8, label="pool")
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


def plot_sweep(sweep, path: Path) -> None:
    """Hit rate (and block ratio) per swept value, with the unlimited-pool reference line; with
    the host tier, the hit rate by tier as stacked bars instead."""
    plt = require_matplotlib()
    if all(row.result.host_tier is not None for row in sweep.rows) and sweep.rows:
        _plot_tiers(plt, sweep, path)
        return
    labels = [str(row.value) for row in sweep.rows]
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(x, [row.result.prefix.hit_rate for row in sweep.rows], marker="o", label="hit rate (tokens)")
    ax.plot(x, [row.result.prefix.block_ratio for row in sweep.rows], marker="s", label="block ratio")
    ax.axhline(sweep.reference.hit_rate, color="grey", ls="--", label=f"unlimited ({sweep.reference.method})")
    top = max([sweep.reference.hit_rate] + [row.result.prefix.hit_rate for row in sweep.rows])
    ax.set_ylim(0, max(top * 1.15, 0.01))
    ax.set_xticks(x, labels)
    ax.set_xlabel(sweep.key)
    ax.set_ylabel("hit rate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


TIERS = (("device_hit", "device hit"), ("host_loaded", "host hit, loaded back"),
         ("host_skipped", "host hit, skipped (recomputed)"))


def _plot_tiers(plt, sweep, path: Path) -> None:
    """Stacked bars: the hit rate by tier per swept value (a host size, a write policy), and
    the unlimited-pool reference."""
    labels = [str(row.value) for row in sweep.rows]
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = np.zeros(len(x))
    for key, label in TIERS:
        values = np.array([row.result.host_tier.rates[key] for row in sweep.rows])
        ax.bar(x, values, bottom=bottom, label=label, width=0.6)
        bottom += values
    ax.axhline(sweep.reference.hit_rate, color="grey", ls="--", label=f"unlimited ({sweep.reference.method})")
    ax.set_ylim(0, max(float(bottom.max()), sweep.reference.hit_rate) * 1.15 + 1e-3)
    ax.set_xticks(x, labels)
    ax.set_xlabel(sweep.key)
    ax.set_ylabel("share of prompt tokens")
    ax.set_title("hit rate by tier (hiradix)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
