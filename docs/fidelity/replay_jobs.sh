# Sourced by docs/fidelity/measure.sh and measure_0523.sh: a list of replays and the runner.
#
# add_job NAME FILE ARGS   appends a replay to $OUT/jobs.tsv (name <TAB> trace file <TAB> memcli
#                          arguments, the engine included)
# run_jobs                 runs every replay of $OUT/jobs.tsv, $JOBS at once, each as
#                          `$MEMCLI replay FILE ARGS --jobs 1 --json` into $OUT/json/NAME.json; a
#                          document already there is reused, so a rerun only does what is missing
#                          or failed; each replay's wall time is appended to $OUT/times.tsv
# bundled_traces           sets TRACES to the bundled traces, each with the built-in replay
#                          config's 4 Mi-token pool and a 200 k pool of 64 rows where eviction
#                          matters (trace label | file | pool label | --set arguments for the pool)
# Needs OUT, MEMCLI and JOBS set (and ROOT for bundled_traces).

bundled_traces() {
  local small="--set memory.max_total_tokens=200000 --set memory.max_running_requests=64"
  TRACES=(
    "conv300|$ROOT/tests/data/conversation_head300.jsonl|4Mi|"
    "conv300|$ROOT/tests/data/conversation_head300.jsonl|200k|$small"
    "syn200|$ROOT/tests/data/synthetic_head200.jsonl|4Mi|"
    "syn200|$ROOT/tests/data/synthetic_head200.jsonl|200k|$small"
  )
}

add_job() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$OUT/jobs.tsv"; }

run_line() {  # the job on line $1 of jobs.tsv
  local name file args out t0 try
  IFS=$'\t' read -r name file args < <(sed -n "${1}p" "$OUT/jobs.tsv")
  out=$OUT/json/$name.json
  [ -s "$out" ] && return 0
  for try in 1 2 3; do  # retried: a replay can fail while the code is being edited
    t0=$(date +%s.%N)
    # shellcheck disable=SC2086
    if $MEMCLI replay "$file" $args --jobs 1 --json > "$out.tmp" 2> "$OUT/json/$name.err"; then
      mv "$out.tmp" "$out"
      printf '%s\t%s\n' "$name" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')" \
        | tee -a "$OUT/times.tsv" >&2
      return 0
    fi
    echo "failed $name (try $try): $(head -c 300 "$OUT/json/$name.err")" >&2
    sleep 5
  done
  rm -f "$out.tmp"
}

run_jobs() {
  mkdir -p "$OUT/json"
  export -f run_line
  export OUT MEMCLI
  seq "$(wc -l < "$OUT/jobs.tsv")" | xargs -P "$JOBS" -I{} bash -c 'run_line {}'
}
