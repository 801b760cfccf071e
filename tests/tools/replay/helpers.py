"""Shared pieces of the replay tests: small configs and an independent hit computation."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from memcli.config import Config, config_from_dict

DATA = Path(__file__).resolve().parents[2] / "data"
CONVERSATION = DATA / "conversation_head300.jsonl"
SYNTHETIC = DATA / "synthetic_head200.jsonl"


def small_config(page_size: int = 16, pool: int = 200_000, rows: int = 16, context: int = 65_536, **sections) -> Config:
    """A CPU stack with an indices-only pool; `sections` update whole config sections."""
    raw = {
        "memory": {"page_size": page_size, "max_total_tokens": pool, "max_running_requests": rows,
                   "max_context_len": min(context, pool), "kv_pool": "indices"},
        "scheduler": {"chunked_prefill_size": 4096 // page_size * page_size, "max_prefill_tokens": 8192},
        "runtime": {"device": "cpu", "kernel_backend": "torch"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


def page_prefix_hits(inputs: list[np.ndarray], page_size: int) -> list[int]:
    """Independent model of an unlimited cache under sequential arrivals: a set of every
    page-aligned prefix of every earlier prompt; a request hits its longest page-aligned
    prefix in the set, at most input_len - 1 tokens."""
    seen: set[bytes] = set()
    hits = []
    for ids in inputs:
        limit = (len(ids) - 1) // page_size * page_size
        hit = 0
        for end in range(page_size, limit + 1, page_size):
            if ids[:end].tobytes() not in seen:
                break
            hit = end
        hits.append(hit)
        for end in range(page_size, len(ids) + 1, page_size):
            seen.add(ids[:end].tobytes())
    return hits


def shrink_mooncake(src: Path, dst: Path, num_requests: int, block_size: int = 8, output_div: int = 50) -> Path:
    """Write the first requests of a Mooncake trace with `block_size`-token blocks instead of
    512: the same hash ids (so the same sharing), about 512 / block_size times fewer tokens."""
    import json

    lines = []
    with open(src) as fh:
        for line in fh:
            row = json.loads(line)
            blocks = len(row["hash_ids"])
            rem = row["input_length"] - (blocks - 1) * 512
            row["input_length"] = (blocks - 1) * block_size + max(1, -(-rem * block_size // 512))
            row["output_length"] = max(1, row["output_length"] // output_div)
            lines.append(json.dumps(row))
            if len(lines) == num_requests:
                break
    dst.write_text("\n".join(lines) + "\n")
    return dst


def plant_leak(monkeypatch, after_step: int) -> None:
    """Make the scheduler take one page after step `after_step` that nobody will ever free.
    The step before it is left to the plain loop (a decode run taken at once ends before it),
    so the page is taken at that step whichever loop the replay runs."""
    from memcli.sched.decode_run import DecodeRuns
    from memcli.sched.scheduler import Scheduler

    step, steady = Scheduler.step, DecodeRuns.steady

    def leaky_step(self):
        record = step(self)
        if self.step_count == after_step:
            self.memory.allocator.alloc(self.page_size)
        return record

    def steady_before_the_leak(self, limit):
        before = after_step - 1 - self.sched.step_count  # steps a run may take before the leaking one
        return steady(self, min(limit, before) if before >= 0 else limit)

    monkeypatch.setattr(Scheduler, "step", leaky_step)
    monkeypatch.setattr(DecodeRuns, "steady", steady_before_the_leak)
