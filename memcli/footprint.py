"""What a memory stack will allocate, checked against what the device has before anything
is allocated (`check_footprint`, called by `memcli.stack.build_stack`).

The estimate counts the buffers that grow with the config: K/V (when `memory.kv_pool` is
materialized), `req_to_token`, the allocator's free list (its buffer, the initial `arange`
and a merge), and the radix tree's slot ids (at most one per pool slot). What is available:
free GPU memory on CUDA (`torch.cuda.mem_get_info`), `MemAvailable` of /proc/meminfo on a
CPU (else `os.sysconf`). Over `USABLE_SHARE` of it is a `CapacityError` with a hint.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from memcli.config import Config
from memcli.errors import CapacityError

USABLE_SHARE = 0.9  # leave room for the trace, torch and the rest of the process
FREE_LIST_BYTES_PER_PAGE = 3 * 8  # int64 buffer + the arange that fills it + a merge/sort copy
TREE_BYTES_PER_TOKEN = 16  # radix tree: an int64 slot id and a token id per cached token


LABELS = {"kv_buffers": "K/V buffers", "req_to_token": "req_to_token", "free_lists": "free lists",
          "tree": "radix tree"}


class StackBytes(NamedTuple):
    """Bytes each part of a stack allocates. `total` is their sum."""

    kv_buffers: int
    req_to_token: int
    free_lists: int
    tree: int

    @property
    def total(self) -> int:
        return sum(self)


def estimate_stack_bytes(config: Config, kv_pool: str | None = None) -> StackBytes:
    """The stack `build_stack(config)` would allocate (`kv_pool` overrides memory.kv_pool)."""
    mem, model = config.memory, config.model
    size, ps = config.pool_size, config.page_size
    materialized = (kv_pool or mem.kv_pool) == "materialized"
    kv = model.bytes_per_token * (size + ps) if materialized else 0
    rows = mem.max_running_requests * config.req_to_token_cols * 4
    free = (size // ps + 1) * FREE_LIST_BYTES_PER_PAGE
    tree = size * TREE_BYTES_PER_TOKEN if config.cache.kind in ("radix", "hiradix") else 0
    return StackBytes(kv, rows, free, tree)


def available_bytes(device: torch.device) -> tuple[int, str]:
    """Memory the device can still give, and where the figure comes from."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, "free GPU memory"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available physical memory"


def check_footprint(config: Config, device: torch.device) -> StackBytes:
    """Raise `CapacityError` when the stack would not fit on `device`; return the estimate."""
    need = estimate_stack_bytes(config)
    have, source = available_bytes(device)
    usable = int(have * USABLE_SHARE)
    if need.total <= usable:
        return need
    parts = ", ".join(f"{LABELS[name]} {gib(value)}" for name, value in need._asdict().items() if value)
    raise CapacityError(
        f"memory: the stack needs {gib(need.total)} ({parts}) but the {device.type} has {gib(have)}"
        f" ({source}; {USABLE_SHARE:.0%} usable: {gib(usable)})",
        _hint(config, need, usable),
    )


def _hint(config: Config, need: StackBytes, usable: int) -> str:
    ps = config.page_size
    if need.kv_buffers and estimate_stack_bytes(config, "indices").total <= usable:
        return "use --set memory.kv_pool=indices (slot bookkeeping only, no K/V buffers)"
    kv_per_token = config.model.bytes_per_token if need.kv_buffers else 0
    fixed = need.req_to_token + FREE_LIST_BYTES_PER_PAGE + kv_per_token * ps
    per_token = kv_per_token + FREE_LIST_BYTES_PER_PAGE / ps + (TREE_BYTES_PER_TOKEN if need.tree else 0)
    tokens = int((usable - fixed) // per_token) // ps * ps if usable > fixed else 0
    if tokens >= max(ps, config.memory.max_context_len):
        extra = "" if config.memory.max_total_tokens is not None else " and memory.kv_budget_gib=null"
        return f"the largest pool that fits: --set memory.max_total_tokens={tokens}{extra}"
    return ("lower memory.max_running_requests or memory.max_context_len"
            f" (req_to_token alone takes {gib(need.req_to_token)}), or use a smaller pool")


def gib(num_bytes: int) -> str:
    if num_bytes >= 1 << 30:
        return f"{num_bytes / (1 << 30):,.1f} GiB"
    return f"{num_bytes / (1 << 20):,.1f} MiB"
