"""The vLLM 0.33 long runs of docs/FIDELITY.md: vLLM's real scheduler and memcli's, side by side
(`memcli/reference/vllm033/steps.py: SideBySide`), on the first N requests of a trace.

    python docs/fidelity/vllm_long_runs.py POOL_TOKENS burst|timestamp async|sync [fcfs|priority]
        [--trace FILE] [--limit N]

Block size 16, vLLM's default budget (2,048 tokens) and max_num_seqs (128), max_model_len
131,072, the built-in replay config's cost model. One JSON line on stdout: steps, whether a step
diverged (and the first divergent step of both sides), preemptions, finishes, both sides'
prefix-cache counters (queries, hits, preempted queries, preempted hits) and the wall time.
"""

import argparse
import json
import time

from memcli.config import load_config
from memcli.reference.vllm033.steps import SideBySide
from memcli.vllm_sched.scheduler import VllmSchedulerConfig
from memcli.workload.readers import read_trace
from memcli.workload.spec import output_token_base


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("pool", type=int)
    p.add_argument("arrivals", choices=("burst", "timestamp"))
    p.add_argument("loop", choices=("async", "sync"))
    p.add_argument("policy", nargs="?", default="fcfs", choices=("fcfs", "priority"))
    p.add_argument("--trace", default="/work/shared/traces/conversation_trace.jsonl")
    p.add_argument("--limit", type=int, default=2000)
    a = p.parse_args()
    trace = read_trace(a.trace, limit=a.limit)
    settings = VllmSchedulerConfig(2048, 128, 131072, policy=a.policy, async_scheduling=a.loop == "async")
    sim = load_config(None, ["semantics.engine=vllm-0.33"], builtin="replay").sim
    start = time.time()
    r = SideBySide(trace.requests, settings, 16, a.pool // 16, a.arrivals, sim,
                   token_base=output_token_base(trace)).run()
    out = {"pool": a.pool, "arrivals": a.arrivals, "loop": a.loop, "policy": a.policy, "steps": r.steps,
           "divergent": r.divergence is not None, "preemptions": r.preemptions, "finished": r.finished,
           "real_stats": r.real_stats, "mem_stats": r.mem_stats, "wall_s": round(time.time() - start, 1)}
    if r.divergence:
        out["first"] = [line for obs in r.divergence for line in obs.lines()][:40]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
