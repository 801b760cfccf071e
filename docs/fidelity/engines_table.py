"""docs/fidelity/engines.csv from the replay documents of docs/fidelity/engines.sh: one row per
replay (trace, pool, run), with its hit rate, cached tokens, evictions, tokens evicted,
preemptions (SGLang's retractions, vLLM's preemptions), steps and wall time.

    python docs/fidelity/engines_table.py OUT_DIR > docs/fidelity/engines.csv
"""

import csv
import json
import sys
from pathlib import Path

COLUMNS = ("trace", "pool", "run", "engine", "page_size", "pool_tokens", "requests", "hit_rate", "cached_tokens",
           "evictions", "tokens_evicted", "preemptions", "recomputed_tokens", "steps", "wall_time_s")


def row(path: Path) -> dict:
    doc = json.loads(path.read_text())
    trace, pool, run = path.stem.split("-", 2)
    summary, sched, evict = doc["summary"], doc["scheduling"], doc["eviction"]
    return {"trace": trace, "pool": pool, "run": run, "engine": doc["config"]["semantics"]["engine"],
            "page_size": doc["page_size"], "pool_tokens": doc["config"]["memory"]["max_total_tokens"],
            "requests": doc["requests"], "hit_rate": doc["hit_rate"], "cached_tokens": doc["cached_tokens"],
            "evictions": evict["evictions"], "tokens_evicted": evict["tokens_evicted"],
            "preemptions": sched["retractions"], "recomputed_tokens": sched["recomputed_tokens"],
            "steps": summary.get("steps"), "wall_time_s": summary.get("wall_time_s")}


def main() -> None:
    rows = [row(p) for p in sorted(Path(sys.argv[1]).glob("*.json"))]
    out = csv.DictWriter(sys.stdout, COLUMNS, lineterminator="\n")
    out.writeheader()
    out.writerows(rows)


if __name__ == "__main__":
    main()
