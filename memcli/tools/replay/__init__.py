"""`memcli replay`: continuous batching over a trace; hit rates, allocation, eviction, integrity.

The home of one replay: `run.py` (the entry, `run_replay`), `results.py` (what a replay
returns), `report.py` (its JSON document and tables); `runner.py` drives the scheduler
step by step. A study of many replays is `memcli.tools.study`.
"""

# Defaults shown in --help live here, so that --help imports no torch or numpy.
ARRIVALS = ("timestamp", "burst", "sequential")
# `--check` alone checks incrementally; `--check full` walks the whole pool every step.
CHECK_LEVELS = ("incremental", "full")
