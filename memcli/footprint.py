"""What a memory stack will allocate, checked against what the device has before anything
is allocated (`check_footprint`, called by `memcli.stack.build_stack`).

The estimate counts the buffers that grow with the config: K/V (when `memory.kv_pool` is
materialized), `req_to_token`, the allocator's free list (its buffer, the initial `arange`
and a merge), the radix tree's slot ids (at most one per pool slot), and the hiradix host
pool (its free ring and the `arange` that fills it, and on a GPU with materialized K/V its
pinned K/V buffers), which lives in host memory whatever the device. What is available: free
GPU memory on CUDA (`torch.cuda.mem_get_info`), `MemAvailable` of /proc/meminfo for host
memory (else `os.sysconf`). Over `USABLE_SHARE` of it is a `CapacityError` with a hint.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from memcli.config import GIB, RANGES, Config, host_pool_size
from memcli.errors import CapacityError
from memcli.mem_cache.pages import align_down, whole_pages

USABLE_SHARE = 0.9  # leave room for the trace, torch and the rest of the process
FREE_LIST_BYTES_PER_PAGE = 3 * 8  # int64 buffer + the arange that fills it + a merge/sort copy
TREE_BYTES_PER_TOKEN = 16  # radix tree: an int64 slot id and a token id per cached token
# Host pool: its int64 free ring, and the arange that fills it or an integrity check's copy of
# the free list with its one-byte mark per slot.
HOST_RING_BYTES_PER_TOKEN = 2 * 8 + 1
HINT_SHARE = 0.8  # a hint's host pool takes this share of the room left


LABELS = {"kv_buffers": "K/V buffers", "req_to_token": "req_to_token", "free_lists": "free lists",
          "tree": "radix tree", "host_pool": "host pool"}


class StackBytes(NamedTuple):
    """Bytes each part of a stack allocates. `total` is their sum; `host_pool` is in host
    memory (on a GPU the rest is on the device)."""

    kv_buffers: int
    req_to_token: int
    free_lists: int
    tree: int
    host_pool: int = 0

    @property
    def total(self) -> int:
        return sum(self)

    @property
    def on_device(self) -> int:
        return self.total - self.host_pool


def estimate_stack_bytes(config: Config, kv_pool: str | None = None, device_type: str = "cpu") -> StackBytes:
    """The stack `build_stack(config)` would allocate (`kv_pool` overrides memory.kv_pool)."""
    mem, model = config.memory, config.model
    size, ps = config.pool_size, config.page_size
    materialized = (kv_pool or mem.kv_pool) == "materialized"
    kv = model.bytes_per_token * (size + ps) if materialized else 0
    rows = mem.max_running_requests * config.req_to_token_cols * 4
    free = (whole_pages(size, ps) + 1) * FREE_LIST_BYTES_PER_PAGE
    tree = size * TREE_BYTES_PER_TOKEN if config.cache.kind in ("radix", "hiradix") else 0
    host_tokens = host_pool_size(config)
    host_kv = model.bytes_per_token if materialized and device_type == "cuda" else 0  # `stack.make_host_pool`
    return StackBytes(kv, rows, free, tree, host_tokens * (HOST_RING_BYTES_PER_TOKEN + host_kv))


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
    """Raise `CapacityError` when the stack would not fit on `device` (and its host pool in
    host memory); return the estimate."""
    need = estimate_stack_bytes(config, device_type=device.type)
    here = need  # what `device`'s memory holds: on a GPU, all but the host pool
    if device.type == "cuda" and need.host_pool:
        _check_host_pool(config, need)
        here = need._replace(host_pool=0)
    have, source = available_bytes(device)
    usable = int(have * USABLE_SHARE)
    if here.total <= usable:
        return need
    parts = ", ".join(f"{LABELS[name]} {gib(value)}" for name, value in here._asdict().items() if value)
    raise CapacityError(
        f"memory: the stack needs {gib(here.total)} ({parts}) but the {device.type} has {gib(have)}"
        f" ({source}; {USABLE_SHARE:.0%} usable: {gib(usable)})",
        _hint(config, here, usable),
    )


def _check_host_pool(config: Config, need: StackBytes) -> None:
    """A GPU stack's host pool against host memory."""
    have, source = available_bytes(torch.device("cpu"))
    usable = int(have * USABLE_SHARE)
    if need.host_pool > usable:
        raise CapacityError(f"memory: the hiradix host pool needs {gib(need.host_pool)} but the host has {gib(have)}"
                            f" ({source}; {USABLE_SHARE:.0%} usable: {gib(usable)})", _host_hint(config, need, usable))


def _host_hint(config: Config, need: StackBytes, room: int) -> str:
    """The largest host pool that fits in `room` bytes, as the setting the config sizes it by."""
    tokens = host_pool_size(config)
    per_token = need.host_pool // tokens
    # A fifth of the room is left for what else the machine's memory does before the run.
    fit = int(room * HINT_SHARE) // per_token // config.page_size * config.page_size
    what = f"the host pool holds {tokens:,} tokens at {per_token:,} bytes each"
    cache = config.cache
    if fit <= config.pool_size:  # SGLang's host pool must be larger than the device pool
        return f"{what}; a host pool larger than the device pool does not fit: lower memory.max_total_tokens"
    if cache.host_size_gib is not None:
        size_gib = int(fit * config.model.bytes_per_token / GIB * 10) / 10
        return f"{what}: --set cache.host_size_gib={size_gib} fits"
    ratio = min(int(fit / config.pool_size * 100) / 100, RANGES["cache.host_ratio"].high)
    return f"{what}: --set cache.host_ratio={ratio:g} fits"


def _hint(config: Config, need: StackBytes, usable: int) -> str:
    if need.host_pool and need.on_device <= usable:
        return _host_hint(config, need, usable - need.on_device)
    ps = config.page_size
    if need.kv_buffers and estimate_stack_bytes(config, "indices").total <= usable:
        return "use --set memory.kv_pool=indices (slot bookkeeping only, no K/V buffers)"
    kv_per_token = config.model.bytes_per_token if need.kv_buffers else 0
    fixed = need.req_to_token + FREE_LIST_BYTES_PER_PAGE + kv_per_token * ps
    per_token = kv_per_token + FREE_LIST_BYTES_PER_PAGE / ps + (TREE_BYTES_PER_TOKEN if need.tree else 0)
    tokens = align_down(int((usable - fixed) // per_token), ps) if usable > fixed else 0
    if tokens >= max(ps, config.memory.max_context_len):
        extra = "" if config.memory.max_total_tokens is not None else " and memory.kv_budget_gib=null"
        return f"the largest pool that fits: --set memory.max_total_tokens={tokens}{extra}"
    return ("lower memory.max_running_requests or memory.max_context_len"
            f" (req_to_token alone takes {gib(need.req_to_token)}), or use a smaller pool")


def gib(num_bytes: int) -> str:
    if num_bytes >= 1 << 30:
        return f"{num_bytes / (1 << 30):,.1f} GiB"
    return f"{num_bytes / (1 << 20):,.1f} MiB"
