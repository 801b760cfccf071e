"""The move from SGLang 0.5.5 to 0.5.23, one key at a time: which replays, and their CSV.

    python docs/fidelity/effects_0523.py variants           the replays of one trace and pool
    python docs/fidelity/effects_0523.py skipped            the keys not replayed, and why
    python docs/fidelity/effects_0523.py csv JSON_DIR CSV   one row per replay document

`variants` prints one line per replay: name <TAB> eviction policy <TAB> engine <TAB> the
`--sweep` arguments (docs/fidelity/measure_0523.sh runs them). The keys and their values are
memcli's own (`memcli.config.SGLANG_0523_CHOICES` where it differs from the `sglang-0.5.5`
profile, in that order, as in tests/test_engine_keys.py); nothing here restates a value.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import NamedTuple

try:
    from memcli.config import PROFILE_CHOICES, SGLANG_0523_CHOICES
except ImportError as exc:
    print(f"error: {sys.executable} cannot import memcli ({exc})\n"
          "hint: PYTHON=/path/to/venv/bin/python docs/fidelity/measure_0523.sh ...", file=sys.stderr)
    sys.exit(2)

OLD, NEW = "sglang-0.5.5", "sglang-0.5.23"
KEYS = tuple(k for k, v in SGLANG_0523_CHOICES.items() if PROFILE_CHOICES[k][OLD] != v)
HOST_TIER = "read by the host tier only (cache.kind hiradix)"
NOT_REPLAYED = {
    "chunk_cache_protected": "read by the chunk cache only (cache.kind chunk), which reports it and nothing else",
    **{k: HOST_TIER for k in ("host_pool_floor", "hicache_ack", "hicache_evict", "host_pool_padding",
                              "write_back_demote", "write_back_host_reclaim")},
}
# Hit counts are read by LFU only: these keys are replayed under LFU, against 0.5.5 under LFU.
LFU_ONLY = ("lfu_hits",)
# Keys that act together, switched together as well as alone.
PAIRS = {
    "lru": (("rem_input_gate", "admission_reserve"),  # the chunking gate lives in the page-reserve admission
            ("prompt_split", "tree_stamps")),  # the prompt split is a step of 0.5.23's insert walk only
    "lfu": (("lfu_hits", "tree_stamps"),),  # a 0.5.23 split keeps the upper node's hit count
}
TRACE_ORDER = ("conv300", "syn200", "conversation", "synthetic")
POOL_ORDER = ("4Mi", "200k", "1M")
CSV_FIELDS = ("trace", "pool", "pool_tokens", "page_size", "eviction_policy", "key", "value", "hit_rate",
              "cached_tokens", "baseline", "delta_points", "delta_cached_tokens", "evictions", "tokens_evicted",
              "steps", "retractions", "wall_time_s")


class Variant(NamedTuple):
    """One replay of a trace and pool: `switched` (key, value) pairs from `engine`'s profile."""

    name: str  # `baseline`, `engine`, a key, or keys joined by `+`
    policy: str  # cache.eviction_policy
    engine: str
    switched: tuple[tuple[str, str], ...]

    @property
    def sweep(self) -> str:
        return " ".join(f"--sweep semantics.{k}={v}" for k, v in self.switched)


def _switch(keys: tuple[str, ...], policy: str) -> Variant:
    return Variant("+".join(keys), policy, OLD, tuple((k, SGLANG_0523_CHOICES[k]) for k in keys))


def variants() -> list[Variant]:
    """Per policy: plain 0.5.5 (the baseline), each key alone, the pairs, the whole 0.5.23 engine."""
    out = []
    for policy in ("lru", "lfu"):
        out.append(Variant("baseline", policy, OLD, (("engine", OLD),)))
        if policy == "lru":
            keys = [k for k in KEYS if k not in NOT_REPLAYED and k not in LFU_ONLY]
        else:
            keys = list(LFU_ONLY)
        out += [_switch((k,), policy) for k in keys]
        out += [_switch(pair, policy) for pair in PAIRS[policy]]
        out.append(Variant("engine", policy, NEW, (("engine", NEW),)))
    return out


def _rank(order: tuple[str, ...], label: str) -> tuple[int, str]:
    return (order.index(label) if label in order else len(order), label)


def read_rows(json_dir: Path) -> list[dict]:
    """One row per `TRACE__POOL__POLICY__NAME.json` whose name is a variant, in table order."""
    index = {(v.policy, v.name): i for i, v in enumerate(variants())}
    rows = []
    for path in json_dir.glob("*.json"):
        trace, pool, policy, name = path.stem.split("__")
        if (policy, name) not in index:
            print(f"skipped {path.name}: not a replay of this study", file=sys.stderr)
            continue
        point = json.loads(path.read_text())["points"][0]
        rows.append({"trace": trace, "pool": pool, "pool_tokens": point["pool_tokens"],
                     "page_size": point["page_size"], "eviction_policy": policy, "key": name,
                     "value": "+".join(point["point"].values()),
                     **{f: point[f] for f in ("hit_rate", "cached_tokens", "evictions", "tokens_evicted",
                                              "steps", "retractions", "wall_time_s")}})
    rows.sort(key=lambda r: (_rank(TRACE_ORDER, r["trace"]), _rank(POOL_ORDER, r["pool"]),
                             index[(r["eviction_policy"], r["key"])]))
    return rows


def add_deltas(rows: list[dict]) -> None:
    """Give each row its baseline (plain 0.5.5, same trace, pool and policy) and its delta."""
    base = {(r["trace"], r["pool"], r["eviction_policy"]): r for r in rows if r["key"] == "baseline"}
    for r in rows:
        b = base.get((r["trace"], r["pool"], r["eviction_policy"]))
        r["baseline"] = OLD if r["eviction_policy"] == "lru" else f"{OLD} under {r['eviction_policy']}"
        r["delta_points"] = "" if b is None else f"{100 * (r['hit_rate'] - b['hit_rate']):+.4f}"
        r["delta_cached_tokens"] = "" if b is None else r["cached_tokens"] - b["cached_tokens"]


def write_csv(json_dir: Path, dst: Path) -> None:
    rows = read_rows(json_dir)
    if not rows:
        _fail(f"no replay documents in {json_dir}", "run docs/fidelity/measure_0523.sh first")
    add_deltas(rows)
    with open(dst, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    print(f"{len(rows)} rows -> {dst}", file=sys.stderr)


def _fail(what: str, hint: str) -> None:
    print(f"error: {what}\nhint: {hint}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str]) -> None:
    if argv[:1] == ["variants"]:
        for v in variants():
            print(f"{v.name}\t{v.policy}\t{v.engine}\t{v.sweep}")
    elif argv[:1] == ["skipped"]:
        for key in KEYS:
            if key in NOT_REPLAYED:
                print(f"{key}\t{SGLANG_0523_CHOICES[key]}\t{NOT_REPLAYED[key]}")
    elif argv[:1] == ["csv"] and len(argv) == 3:
        write_csv(Path(argv[1]), Path(argv[2]))
    else:
        _fail(f"unknown arguments: {' '.join(argv) or '(none)'}",
              "effects_0523.py variants | skipped | csv JSON_DIR CSV")


if __name__ == "__main__":
    main(sys.argv[1:])
