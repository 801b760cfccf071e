"""Small stacks and requests for scheduler and allocation tests."""

from __future__ import annotations

import numpy as np

from memcli.config import load_config
from memcli.stack import build_stack


def small_config(page_size: int = 1, pool: int = 256, cache: str = "radix", rows: int = 8, context: int = 128,
                 chunk: int | None = None, **extra):
    sets = [
        f"memory.page_size={page_size}",
        f"memory.max_total_tokens={pool}",
        f"memory.max_running_requests={rows}",
        f"memory.max_context_len={min(context, pool)}",
        f"cache.kind={cache}",
        "runtime.device=cpu",
        f"scheduler.chunked_prefill_size={'null' if chunk is None else chunk}",
    ]
    sets += [f"{k.replace('__', '.')}={v}" for k, v in extra.items()]
    return load_config(None, sets)


def small_stack(page_size: int = 1, pool: int = 256, cache: str = "radix", **kw):
    cfg = small_config(page_size, pool, cache, **kw)
    return cfg, build_stack(cfg)


def tokens(*runs) -> np.ndarray:
    """tokens((0, 5), (100, 3)) -> [0,1,2,3,4,100,101,102]."""
    return np.concatenate([np.arange(start, start + n, dtype=np.int64) for start, n in runs])


def scheduler_for(stack, cfg, check_every_step: bool = False, page_size: int | None = None, **hooks):
    """The scheduler over `stack`'s memory manager; `check_every_step` runs the full walk after
    every step, other keywords are `SchedulerHooks` fields."""
    from memcli.mem_cache.integrity import CheckPolicy
    from memcli.sched.scheduler import Scheduler, SchedulerHooks

    checks = CheckPolicy("full" if check_every_step else "none")
    return Scheduler(stack.memory, cfg, SchedulerHooks(checks=checks, page_size=page_size or stack.scheduler_page_size,
                                                       **hooks))
