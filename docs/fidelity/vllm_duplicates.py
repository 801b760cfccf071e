"""Duplicate blocks in a vLLM 0.33 replay (docs/fidelity/ENGINES.md): vLLM's cached map keeps a
second block under a hash it already holds (two running requests computing the same block, or
the recomputed last block of a fully cached prompt), and each copy holds pool capacity until it
is evicted. Counted on memcli's block pool (proven equal to vLLM's, block for block) during an
ordinary `memcli replay`.

    python docs/fidelity/vllm_duplicates.py TRACE [memcli replay arguments...]

One JSON line: blocks cached as a duplicate over the run, the most duplicate blocks held at
once (cached blocks minus distinct hashes, read after every step) and its mean over the steps.
"""

import json
import sys

from memcli.mem_cache.block_pool import BlockPool


def main() -> None:
    counts = {"created": 0, "peak": 0, "sum": 0, "steps": 0}
    cache_full_blocks = BlockPool.cache_full_blocks

    def counting(self, blocks, hashes, num_cached, num_full, *args, **kwargs):
        before = self.num_cached - len(self.cached)
        cache_full_blocks(self, blocks, hashes, num_cached, num_full, *args, **kwargs)
        counts["created"] += self.num_cached - len(self.cached) - before

    BlockPool.cache_full_blocks = counting
    pools: list = []
    init = BlockPool.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        pools.append(self)

    BlockPool.__init__ = keep
    from memcli.vllm_sched.scheduler import VllmScheduler
    step = VllmScheduler.step

    def sampled(self):
        record = step(self)
        pool = self.memory.pool
        held = pool.num_cached - len(pool.cached)
        counts["peak"] = max(counts["peak"], held)
        counts["sum"] += held
        counts["steps"] += 1
        return record

    VllmScheduler.step = sampled
    from memcli.cli.app import app
    try:
        app(["replay", *sys.argv[1:], "--engine", "vllm-0.33", "--json"], standalone_mode=False)
    finally:
        mean = counts["sum"] / counts["steps"] if counts["steps"] else 0.0
        print(json.dumps({"args": sys.argv[1:], "duplicates_created": counts["created"], "peak_duplicate_blocks":
                          counts["peak"], "mean_duplicate_blocks": round(mean, 1), "steps": counts["steps"]}))


if __name__ == "__main__":
    main()
