"""Print a markdown table of docs/FIDELITY.md ("From 0.5.5 to 0.5.23, measured") from its CSV.

    python docs/fidelity/effects_0523_table.py [CSV] [--traces conversation,synthetic]

CSV defaults to docs/fidelity/effects_0523.csv; --traces to the real traces (the bundled ones:
--traces conv300,syn200). One column per trace and pool (a real trace always has its 4 Mi and
1 M columns, `not run` where the CSV lacks them); one row per replay: each policy's baseline
hit rate, then each key's delta against it in hit-rate points (cached tokens), the whole
`sglang-0.5.23` engine last. 0.00 is identical cached tokens, ±0.00 a change under 0.005
points; `not run` a replay the CSV lacks. Reads the CSV only (no memcli import).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

DEFAULT_CSV = Path(__file__).with_name("effects_0523.csv")
POOLS = {"4Mi": "4 Mi", "200k": "200 k", "1M": "1 M"}
REAL_TRACES = ("conversation", "synthetic")
REAL_POOLS = ("4Mi", "1M")  # measure_0523.sh's pools of the real traces


def _tokens(n: int) -> str:
    sign = "+" if n >= 0 else "−"
    n = abs(n)
    if n >= 1_000_000:
        return f"{sign}{n / 1e6:.2f}M"
    return f"{sign}{n / 1e3:.1f}k" if n >= 1000 else f"{sign}{n}"


def cell(row: dict | None) -> str:
    """A key's delta: points (cached tokens); the baseline's own hit rate in italics."""
    if row is None:
        return "not run"
    if row["key"] == "baseline":
        return f"*{100 * float(row['hit_rate']):.2f} %*"
    if row["delta_cached_tokens"] == "":
        return "no baseline"
    tokens = int(row["delta_cached_tokens"])
    if tokens == 0:
        return "0.00"
    points = float(row["delta_points"])
    text = f"{abs(points):.2f} ({_tokens(tokens)})"
    return ("+" if tokens > 0 else "−") + text


def label(policy: str, key: str) -> str:
    under = ", under LFU" if policy == "lfu" else ""
    if key == "baseline":
        return f"*`sglang-0.5.5` hit rate{under}: the base of the rows below*"
    if key == "engine":
        return f"**whole `sglang-0.5.23` engine**{under}"
    return " + ".join(f"`{k}`" for k in key.split("+")) + under


def table(rows: list[dict], traces: tuple[str, ...]) -> str:
    """The table of `traces`; its rows are every replay of the CSV, in the CSV's order."""
    columns = []
    for trace in traces:
        expected = REAL_POOLS if trace in REAL_TRACES else ()
        columns += [(trace, p) for p in POOLS
                    if p in expected or any(r["trace"] == trace and r["pool"] == p for r in rows)]
    lines = list(dict.fromkeys((r["eviction_policy"], r["key"]) for r in rows))
    by = {(r["trace"], r["pool"], r["eviction_policy"], r["key"]): r for r in rows}
    head = ["key"] + [f"{trace} {POOLS.get(pool, pool)}" for trace, pool in columns]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for policy, key in lines:
        cells = [cell(by.get((trace, pool, policy, key))) for trace, pool in columns]
        out.append(f"| {label(policy, key)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str]) -> None:
    traces = REAL_TRACES
    if "--traces" in argv:
        at = argv.index("--traces")
        if at + 1 == len(argv):
            print("error: --traces needs a list\nhint: --traces conv300,syn200", file=sys.stderr)
            sys.exit(2)
        traces = tuple(argv[at + 1].split(","))
        argv = argv[:at] + argv[at + 2:]
    path = Path(argv[0]) if argv else DEFAULT_CSV
    if not path.is_file():
        print(f"error: no CSV at {path}\nhint: docs/fidelity/measure_0523.sh writes it", file=sys.stderr)
        sys.exit(2)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    sys.stdout.write(table(rows, traces) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
