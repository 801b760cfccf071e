#!/usr/bin/env bash
# The host-tier sizing sweep of docs/HOST_TIER.md: the Mooncake conversation trace, a device
# pool of 1,000,000 tokens (built-in replay config otherwise), host pools of 0 (device only),
# 1x, 2x, 4x and 8x the device pool, under each write policy. sglang-0.5.5 profile, with
# semantics.host_pool_floor=any so that a 1x host pool is allowed (it changes nothing for
# larger pools). Writes one JSON document per run into OUT (default /tmp/host-tier-sweep).
set -euo pipefail
TRACE=${TRACE:-/work/shared/traces/conversation_trace.jsonl}
OUT=${OUT:-/tmp/host-tier-sweep}
mkdir -p "$OUT"
BASE=(--engine sglang-0.5.5 --set memory.max_total_tokens=1000000)
memcli replay "$TRACE" "${BASE[@]}" --json > "$OUT/radix.json"
for policy in write_through write_through_selective write_back; do
  memcli replay "$TRACE" "${BASE[@]}" --set cache.kind=hiradix --set cache.write_policy=$policy \
    --set semantics.host_pool_floor=any --sweep cache.host_ratio=1,2,4,8 \
    --plot "$OUT/tiers_$policy.png" --json > "$OUT/hiradix_$policy.json"
done
