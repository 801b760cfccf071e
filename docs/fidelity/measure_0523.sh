#!/usr/bin/env bash
# The measured move from SGLang 0.5.5 to 0.5.23 of docs/FIDELITY.md ("From 0.5.5 to 0.5.23,
# measured"): from --engine sglang-0.5.5, each semantics key on which the engines differ switched
# alone to its 0.5.23 value, keys that act together switched together, and the whole
# sglang-0.5.23 engine; under LRU, and for the hit counts under LFU against 0.5.5 under LFU. The
# replays are those of docs/fidelity/effects_0523.py variants, on the bundled traces and the real
# Mooncake traces, each with the built-in replay config's 4 Mi-token pool and a pool where
# eviction matters; timestamp arrivals, page size 1, each engine's own loop (overlap).
#
#   docs/fidelity/measure_0523.sh [OUT_DIR]      (memcli on PATH, or MEMCLI)
#
# Env: MEMCLI       command that runs memcli (default: memcli)
#      PYTHON       a python that imports memcli (default: python3); it lists the keys
#      JOBS         replays run at once (default 2)
#      QUICK=1      the bundled traces only (104 replays, about 11 min on 2 shared cores, JOBS=1)
#      REAL_TRACES  folder of conversation_trace.jsonl and synthetic_trace.jsonl (default /work/shared/traces)
#      CSV_ONLY=1   no replays: rebuild the CSV from OUT_DIR/json
# One JSON document per replay goes to OUT_DIR/json (default /tmp/memcli-0523; a document
# already there is reused, so a rerun only does what is missing or failed); the summary, one
# row per replay with its baseline (same trace, pool and policy) and its delta against it, to
# docs/fidelity/effects_0523.csv; docs/fidelity/effects_0523_table.py prints its table.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-/tmp/memcli-0523}
MEMCLI=${MEMCLI:-memcli}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-2}
CSV=$ROOT/docs/fidelity/effects_0523.csv
REAL=${REAL_TRACES:-/work/shared/traces}
HELPER=$ROOT/docs/fidelity/effects_0523.py
mkdir -p "$OUT/json"

if [ "${CSV_ONLY:-0}" != 1 ]; then
  variants=$("$PYTHON" "$HELPER" variants) || exit 2
  # Every trace with the context that holds the synthetic trace's longest request (191,386
  # tokens), as in "From 0.5.5 to 0.5.23 on the conversation trace".
  CTX="--set memory.max_context_len=196608"
  # trace label | file | pool label | --set arguments for the pool
  source "$ROOT/docs/fidelity/replay_jobs.sh"
  bundled_traces
  if [ "${QUICK:-0}" != 1 ]; then
    for f in conversation synthetic; do
      [ -s "$REAL/${f}_trace.jsonl" ] || { echo "error: no $REAL/${f}_trace.jsonl" >&2;
        echo "hint: REAL_TRACES=DIR (the folder of the real traces), or QUICK=1 for the bundled ones" >&2; exit 2; }
    done
    TRACES+=(
      "conversation|$REAL/conversation_trace.jsonl|4Mi|"
      "conversation|$REAL/conversation_trace.jsonl|1M|--set memory.max_total_tokens=1000000"
      "synthetic|$REAL/synthetic_trace.jsonl|4Mi|"
      "synthetic|$REAL/synthetic_trace.jsonl|1M|--set memory.max_total_tokens=1000000"
    )
  fi

  : > "$OUT/jobs.tsv"
  for entry in "${TRACES[@]}"; do
    IFS='|' read -r label file pool sets <<< "$entry"
    while IFS=$'\t' read -r name policy engine sweep; do
      add_job "${label}__${pool}__${policy}__${name}" "$file" \
        "--arrivals timestamp --engine $engine $CTX $sets --set cache.eviction_policy=$policy $sweep"
    done <<< "$variants"
  done
  run_jobs
fi

"$PYTHON" "$HELPER" csv "$OUT/json" "$CSV"
