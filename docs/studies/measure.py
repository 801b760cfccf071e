"""Measure a study's executors and Belady's cost (docs/PERFORMANCE.md, "Studies").

    python docs/studies/measure.py OUT_DIR [--trace FILE] [--limit N] [--modes serial,jobs2,ray] [--no-replays]

Runs, one after another in this order, each as its own `memcli` process:

1. one replay of the trace at the default replay config (LRU), then the same under
   `cache.eviction_policy=belady`: each one's wall time (the replay's own `wall_time_s`,
   Belady's index of the trace included) and peak memory;
2. the 24-point study (pool 1M, 2M, 4M, 8M tokens x lru, lfu, fifo x page size 1, 16; the
   policy sweep adds the 8 Belady points, 32 replays in all) serially (`--jobs 1`), in two
   processes (`--jobs 2`) and on a local 2-CPU Ray runtime (`--ray --jobs 2`): wall time of the
   whole command and peak memory of its process tree (the sums of the resident sets and of the
   proportional sets of the process and all its descendants, sampled every 0.2 s);
3. checks that the three studies give the same numbers for every point (wall times aside).

Prints one table and writes OUT_DIR/measure.json. `uptime` is printed before and after: other
work on the machine slows every run and takes cores from the parallel ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

STUDY = ["--sweep", "memory.max_total_tokens=1000000,2000000,4194304,8388608",
         "--sweep", "cache.eviction_policy=lru,lfu,fifo", "--sweep", "memory.page_size=1,16"]
TIMING = ("wall_time_s",)


def _pss_kib(pid: int) -> int:
    """Proportional set size of one process in KiB: its private pages, plus each shared page
    divided by the number of processes mapping it (0 when /proc cannot be read)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_memory_kib(root: int) -> tuple[int, int]:
    """(resident set, proportional set) of `root` and every descendant summed, in KiB.

    The resident sets count a page shared by several processes of the tree (libraries mapped
    by every worker, Ray's shared-memory object store) once per process; the proportional
    sets add up to the physical memory the tree holds."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/statm") as fh:
                pages = int(fh.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)
        rss[pid] = pages * os.sysconf("SC_PAGE_SIZE") // 1024
    total_rss = total_pss = 0
    stack = [root]
    while stack:
        pid = stack.pop()
        total_rss += rss.get(pid, 0)
        total_pss += _pss_kib(pid)
        stack.extend(children.get(pid, []))
    return total_rss, total_pss


def run(args: list[str], out_json: Path) -> dict:
    """Run `memcli ARGS --json`; wall time, peak tree memory and the document."""
    start = time.perf_counter()
    with open(out_json, "w") as out:
        proc = subprocess.Popen(["memcli", *args, "--json"], stdout=out, stderr=subprocess.PIPE, text=True)
        peak = [0, 0]  # resident, proportional
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                rss, pss = tree_memory_kib(proc.pid)
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
                done.wait(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, err = proc.communicate()
        done.set()
        sampler.join()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"memcli {' '.join(args)} failed ({proc.returncode}): {err[-2000:]}")
    return {"args": args, "wall_s": round(wall, 2), "peak_rss_mib": round(peak[0] / 1024, 1),
            "peak_pss_mib": round(peak[1] / 1024, 1), "doc": json.loads(out_json.read_text())}


def points(doc: dict) -> list[dict]:
    return [{k: v for k, v in p.items() if k not in TIMING} for p in doc["points"]]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--trace", default=str(Path(__file__).resolve().parents[3] / "shared/traces/conversation_trace.jsonl"))
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--modes", default="serial,jobs2,ray", help="which study runs, in this order")
    parser.add_argument("--no-replays", action="store_true", help="skip the two single replays")
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    base = ["replay", opts.trace, *(["--limit", str(opts.limit)] if opts.limit else [])]
    print("before:", uptime(), flush=True)
    results = {"before": uptime(), "trace": opts.trace, "limit": opts.limit}
    for name, extra in () if opts.no_replays else (("lru", []), ("belady", ["--set", "cache.eviction_policy=belady"])):
        r = run([*base, *extra], opts.out / f"{name}.json")
        results[name] = {"wall_s": r["wall_s"], "replay_wall_s": r["doc"]["summary"]["wall_time_s"],
                         "peak_rss_mib": r["peak_rss_mib"], "peak_pss_mib": r["peak_pss_mib"], "hit_rate": r["doc"]["hit_rate"]}
        print(name, results[name], flush=True)
    known = {"serial": ["--jobs", "1"], "jobs2": ["--jobs", "2"], "ray": ["--ray", "--jobs", "2"]}
    modes = [(name, known[name]) for name in opts.modes.split(",")]
    docs = {}
    for name, extra in modes:
        r = run([*base, *STUDY, *extra], opts.out / f"study_{name}.json")
        docs[name] = r["doc"]
        results[f"study_{name}"] = {"wall_s": r["wall_s"], "peak_rss_mib": r["peak_rss_mib"],
                                    "peak_pss_mib": r["peak_pss_mib"],
                                    "points": len(r["doc"]["points"])}
        print(name, results[f"study_{name}"], flush=True)
    first = next(iter(docs))
    for name in docs:
        results[f"study_{name}"]["vs_" + first] = round(results[f"study_{name}"]["wall_s"] / results[f"study_{first}"]["wall_s"], 3)
        results[f"study_{name}"]["identical_to_" + first] = points(docs[name]) == points(docs[first])
    if not opts.no_replays:
        results["belady_vs_lru"] = round(results["belady"]["replay_wall_s"] / results["lru"]["replay_wall_s"], 3)
    results["after"] = uptime()
    (opts.out / "measure.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'run':<14}{'wall s':>10}{'vs ' + first:>11}{'RSS MiB':>10}{'PSS MiB':>10}  identical")
    for name in docs:
        s = results[f"study_{name}"]
        print(f"{'study ' + name:<14}{s['wall_s']:>10.1f}{s['vs_' + first]:>11.3f}{s['peak_rss_mib']:>10.0f}"
              f"{s['peak_pss_mib']:>10.0f}  {s['identical_to_' + first]}")
    if not opts.no_replays:
        for name in ("lru", "belady"):
            s = results[name]
            print(f"{'replay ' + name:<14}{s['replay_wall_s']:>10.1f}{'':>11}{s['peak_rss_mib']:>10.0f}"
                  f"{s['peak_pss_mib']:>10.0f}  hit rate {s['hit_rate']:.4f}")
        print(f"belady / lru replay time: {results['belady_vs_lru']}")
    print("after:", results["after"])


if __name__ == "__main__":
    main()
