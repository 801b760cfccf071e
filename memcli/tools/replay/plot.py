"""`--plot FILE.png`: occupancy and running requests over simulated time (matplotlib, optional;
a study's plot is `memcli.tools.study.plot`). The command prints each plot's path on stderr.

matplotlib is the optional extra `plot` (`pip install 'memcli[plot]'`); without it,
`require_matplotlib` raises a `MemcliError` before the replay starts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from memcli.errors import MemcliError
from memcli.tools.replay.results import ReplayResult

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
