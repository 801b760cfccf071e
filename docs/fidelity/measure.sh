#!/usr/bin/env bash
# The measured effects of docs/FIDELITY.md: the whole memcli profile against sglang-0.5.5, the
# event loop flipped alone, and every other semantics key flipped alone to memcli's value from
# the sglang-0.5.5 profile on the normal loop (--set semantics.event_loop=normal), replayed on
# the bundled and the real Mooncake traces, each with the built-in replay config's 4 Mi-token
# pool and with a pool where eviction matters.
#
#   docs/fidelity/measure.sh [OUT_DIR]      (from the repository root, the venv active)
#
# Env: MEMCLI   command that runs memcli (default: memcli)
#      JOBS     replays run at once (default 2)
#      QUICK=1  the bundled traces only (about a minute)
# One JSON document per replay goes to OUT_DIR/json (default /tmp/memcli-fidelity; a document
# already there is reused, so a rerun only does what is missing or failed); the summary,
# one row per replayed value with its baseline (same trace, pool, page size) and its delta
# against it, to docs/fidelity/effects.csv.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-/tmp/memcli-fidelity}
MEMCLI=${MEMCLI:-memcli}
JOBS=${JOBS:-2}
CSV=$ROOT/docs/fidelity/effects.csv
REAL=${REAL_TRACES:-/work/shared/traces}
mkdir -p "$OUT/json"

# Each semantics key and memcli's value (PROFILE_CHOICES in memcli/config.py), flipped on the
# normal loop: the loop is a key of its own, and the whole-profile rows show it with the rest.
PIN="--set semantics.event_loop=normal"
KEYS="evict_amount=shortfall split_stamp=keep lru_clock=simulated retract_requeue=front
retract_batch_order=original chunked_prefix=immediate admission_gate=every_step"
# Keys that cannot act with pages of one token (the page estimate and the chunk floor need a
# page of several tokens; a retracted request's second free is empty): replayed at page size 1
# only as a check (the bundled traces and the conversation trace's 4 Mi pool), and at page size
# 16 where they act (page_estimate, chunk_alignment). lfu_hits is replayed under LFU (under LRU
# hit counts are never read: checked on the bundled traces), and chunk_cache_protected, which
# only changes what a chunk cache reports, and bench_decode_steps, which only bench-one-batch
# reads, are checked on the bundled traces.
ZERO_AT_PS1="page_estimate=exact chunk_alignment=page retract_free=one_call"

# trace label | file | pool label | --set arguments for the pool (and the trace's longest request)
source "$ROOT/docs/fidelity/replay_jobs.sh"
bundled_traces
if [ "${QUICK:-0}" != 1 ]; then
  TRACES+=(
    "conversation|$REAL/conversation_trace.jsonl|4Mi|"
    "conversation|$REAL/conversation_trace.jsonl|1M|--set memory.max_total_tokens=1000000"
    "synthetic|$REAL/synthetic_trace.jsonl|4Mi|--set memory.max_context_len=196608"
    "synthetic|$REAL/synthetic_trace.jsonl|1M|--set memory.max_total_tokens=1000000 --set memory.max_context_len=196608"
  )
fi

# One job per line of $OUT/jobs.tsv (docs/fidelity/replay_jobs.sh), every one from sglang-0.5.5.
: > "$OUT/jobs.tsv"
add() { add_job "$1" "$2" "--engine sglang-0.5.5 $3"; }
for entry in "${TRACES[@]}"; do
  IFS='|' read -r label file pool sets <<< "$entry"
  base="${label}__${pool}"
  # Page size 1, LRU: the whole profile, the loop alone, then each key alone on the normal loop.
  add "${base}__ps1__lru__profile" "$file" "$sets --sweep semantics.profile=sglang-0.5.5,memcli"
  add "${base}__ps1__lru__event_loop" "$file" "$sets --sweep semantics.event_loop=normal"
  checks=$KEYS
  if [[ $label == conv300 || $label == syn200 || $base == conversation__4Mi ]]; then checks="$KEYS $ZERO_AT_PS1"; fi
  for kv in $checks; do
    add "${base}__ps1__lru__${kv%%=*}" "$file" "$sets $PIN --sweep semantics.$kv"
  done
  # LFU: hit counts only order anything under it (under LRU they are never read).
  add "${base}__ps1__lfu__lfu_hits" "$file" "$sets $PIN --set cache.eviction_policy=lfu --sweep semantics.lfu_hits=never,count"
  if [[ $label == conv300 || $label == syn200 ]]; then
    add "${base}__ps1__lru__lfu_hits" "$file" "$sets $PIN --sweep semantics.lfu_hits=count"
    add "${base}__ps1__lru__chunk_cache_protected" "$file" "$sets $PIN --sweep semantics.chunk_cache_protected=zero"
    add "${base}__ps1__lru__bench_decode_steps" "$file" "$sets $PIN --sweep semantics.bench_decode_steps=output_len"
  fi
  # Page size 16: the whole profile, and the two keys that only act when a page holds several tokens.
  ps16="$sets --set memory.page_size=16"
  add "${base}__ps16__lru__profile" "$file" "$ps16 --sweep semantics.profile=sglang-0.5.5,memcli"
  add "${base}__ps16__lru__event_loop" "$file" "$ps16 --sweep semantics.event_loop=normal"
  add "${base}__ps16__lru__page_estimate" "$file" "$ps16 $PIN --sweep semantics.page_estimate=exact"
  add "${base}__ps16__lru__chunk_alignment" "$file" "$ps16 $PIN --sweep semantics.chunk_alignment=page"
done

run_jobs

python3 - "$OUT/json" "$CSV" <<'EOF'
import csv, json, pathlib, sys

src, dst = pathlib.Path(sys.argv[1]), sys.argv[2]
rows = []
for path in sorted(src.glob("*.json")):
    trace, pool, ps, policy, key = path.stem.split("__")
    doc = json.loads(path.read_text())
    for row in doc["points"]:
        rows.append({
            "trace": trace, "pool": pool, "pool_tokens": row["pool_tokens"], "page_size": row["page_size"],
            "eviction_policy": policy, "key": key, "value": next(iter(row["point"].values())),
            "hit_rate": row["hit_rate"], "cached_tokens": row["cached_tokens"],
            "evictions": row["evictions"], "tokens_evicted": row["tokens_evicted"],
            "retractions": row["retractions"], "steps": row["steps"], "wall_time_s": row["wall_time_s"],
        })
# The baseline of a row, at the same trace, pool and page size: the plain sglang-0.5.5 profile
# for the whole profile and the loop; that profile on the normal loop for every other key; and
# under LFU its lfu_hits=never row.
BASELINES = {("profile", "sglang-0.5.5"): "sglang-0.5.5", ("event_loop", "normal"): "sglang-0.5.5 + event_loop=normal",
             ("lfu_hits", "never"): "sglang-0.5.5 + event_loop=normal, lfu"}
def baseline_of(r):
    if r["eviction_policy"] == "lfu":
        return BASELINES[("lfu_hits", "never")]
    return BASELINES[("profile", "sglang-0.5.5")] if r["key"] in ("profile", "event_loop") else BASELINES[("event_loop", "normal")]
base = {}
for r in rows:
    if (r["key"], r["value"]) in BASELINES and (r["key"] == "lfu_hits") == (r["eviction_policy"] == "lfu"):
        base[(r["trace"], r["pool"], r["page_size"], BASELINES[(r["key"], r["value"])])] = r
for r in rows:
    r["baseline"] = baseline_of(r)
    b = base.get((r["trace"], r["pool"], r["page_size"], r["baseline"]))
    r["delta_points"] = "" if b is None else f"{100 * (r['hit_rate'] - b['hit_rate']):+.2f}"
    r["delta_cached_tokens"] = "" if b is None else r["cached_tokens"] - b["cached_tokens"]
with open(dst, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
print(f"{len(rows)} rows -> {dst}", file=sys.stderr)
EOF
