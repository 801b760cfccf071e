#!/usr/bin/env bash
# The numbers of docs/fidelity/ENGINES.md: SGLang 0.5.5 and vLLM 0.33 on the real traces at two
# pool sizes, and one difference between the engines changed at a time where memcli has the knob.
#
#   docs/fidelity/engines.sh [OUT_DIR]      (from the repository root, the venv active)
#
# Env: MEMCLI  command that runs memcli (default: memcli); REAL_TRACES (default /work/shared/traces)
# One JSON document per replay in OUT_DIR (default /tmp/memcli-engines; a document already there is
# reused), one replay at a time, niced; then docs/fidelity/engines.csv (docs/fidelity/engines_table.py).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-/tmp/memcli-engines}
MEMCLI=${MEMCLI:-memcli}
REAL=${REAL_TRACES:-/work/shared/traces}
mkdir -p "$OUT"

# run label | engine and settings (the built-in replay config, timestamp arrivals, every run)
declare -A RUN=(
  [sglang-ps1]="--engine sglang-0.5.5"
  [sglang-ps16]="--engine sglang-0.5.5 --set memory.page_size=16"
  [sglang-ps16-keep]="--engine sglang-0.5.5 --set memory.page_size=16 --set semantics.split_stamp=keep"
  [sglang-ps16-shortfall]="--engine sglang-0.5.5 --set memory.page_size=16 --set semantics.evict_amount=shortfall"
  [sglang-ps16-chunk2048]="--engine sglang-0.5.5 --set memory.page_size=16 --set scheduler.chunked_prefill_size=2048 --set scheduler.max_prefill_tokens=2048"
  [vllm]="--engine vllm-0.33 --set memory.page_size=16"
  [vllm-16384]="--engine vllm-0.33 --set memory.page_size=16 --set scheduler.max_num_batched_tokens=16384 --set scheduler.max_num_seqs=512"
)
# trace label | file | pool label | pool settings
declare -A TRACE=(
  [conversation-1M]="$REAL/conversation_trace.jsonl|--set memory.max_total_tokens=1000000"
  [conversation-4Mi]="$REAL/conversation_trace.jsonl|"
  [synthetic-1M]="$REAL/synthetic_trace.jsonl|--set memory.max_total_tokens=1000000 --set memory.max_context_len=196608"
  [synthetic-4Mi]="$REAL/synthetic_trace.jsonl|--set memory.max_context_len=196608"
)
# trace-pool:run, most wanted first (JOBS in the environment replaces the list)
JOBS=${JOBS:-"conversation-1M:vllm synthetic-1M:vllm conversation-1M:sglang-ps16-keep conversation-1M:sglang-ps16-shortfall
conversation-1M:vllm-16384 synthetic-4Mi:vllm synthetic-1M:sglang-ps16-keep synthetic-1M:sglang-ps16-shortfall
synthetic-1M:vllm-16384 conversation-1M:sglang-ps16-chunk2048 synthetic-1M:sglang-ps16-chunk2048
synthetic-4Mi:vllm-16384 synthetic-4Mi:sglang-ps16-chunk2048 conversation-1M:sglang-ps1"}

for job in $JOBS; do
  tp=${job%%:*} rlabel=${job#*:}
  IFS='|' read -r file pool <<< "${TRACE[$tp]}"
  doc="$OUT/$tp-$rlabel.json"
  [ -s "$doc" ] && continue
  # shellcheck disable=SC2086
  if nice -n 10 $MEMCLI replay "$file" --arrivals timestamp ${RUN[$rlabel]} $pool --json > "$doc.part" 2> "$doc.err"; then
    mv "$doc.part" "$doc"
  else
    echo "failed: $tp $rlabel (see $doc.err)" >&2
  fi
done
python "$ROOT/docs/fidelity/engines_table.py" "$OUT" > "$ROOT/docs/fidelity/engines.csv"
