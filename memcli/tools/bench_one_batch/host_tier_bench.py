"""`bench-one-batch --tree-cache hiradix`: the host tier's copies for the bench's batch, timed.

For each case the batch's prompt KV (`batch_size x input_len` tokens, whole pages, slots taken
from the real allocator of a hiradix stack with a materialized KV pool) is

    backup      gathered from its device slots into host slots (`HostKVPool.backup_from_device`:
                one `index_select` on the device, then non-blocking copies into pinned memory)
    load-back   scattered from the host slots into device slots (`HostKVPool.load_to_device`:
                non-blocking copies into a device staging buffer, then one `index_copy_`)

and, in the same round, a plain copy of the same bytes between one contiguous device tensor
and one pinned host tensor, each way (`copy_(non_blocking=True)`): the bandwidth the link
gives. GB/s are bytes (K and V of every layer, 1 GB = 1e9 bytes) over the median time of a
call from an idle device on a GPU (CUDA events), over the median wall time on a CPU (both
sides are host memory there: the figures measure memory copies, not a link). Each figure is the median of the
round medians.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from memcli.config import Config, replace
from memcli.errors import CapacityError
from memcli.mem_cache.host_pool import HostKVPool, runs
from memcli.mem_cache.pages import align_up
from memcli.report.envelope import envelope
from memcli import engines
from memcli.devices import resolve_device
from memcli.timing import Timing, time_call, torch_threads
from memcli.tools.bench_one_batch.cases import Case

PHASES = ("backup", "load_back", "plain_d2h", "plain_h2d")
LABELS = {"backup": "backup (device -> host slots)", "load_back": "load-back (host -> device slots)",
          "plain_d2h": "plain copy device -> host", "plain_h2d": "plain copy host -> device"}


@dataclass(frozen=True)
class TransferCase:
    """One case's copies: tokens and bytes moved, and the median time of each phase (µs)."""

    case: Case
    tokens: int
    num_bytes: int
    us: dict[str, float]  # phase -> median over rounds of the per-round median (idle-start latency on a GPU)
    host_runs: int  # runs of consecutive host slots the backup wrote

    def gbps(self, phase: str) -> float:
        return self.num_bytes / (self.us[phase] * 1e3) if self.us[phase] > 0 else 0.0

    def share(self, phase: str, plain: str) -> float:
        """Bandwidth of `phase` over the plain copy's in the same direction."""
        base = self.gbps(plain)
        return self.gbps(phase) / base if base else 0.0

    def to_dict(self) -> dict:
        c = self.case
        return {
            "batch_size": c.batch_size, "input_len": c.input_len, "page_size": c.page_size, "tokens": self.tokens,
            "bytes": self.num_bytes, "host_runs": self.host_runs,
            "phases": {p: {"us": round(self.us[p], 3), "latency_us": round(self.us[p], 3),
                           "gbps": round(self.gbps(p), 3)} for p in PHASES},
            "backup_share_of_plain_d2h": round(self.share("backup", "plain_d2h"), 4),
            "load_back_share_of_plain_h2d": round(self.share("load_back", "plain_h2d"), 4),
        }


@dataclass(frozen=True)
class TransferBench:
    config: Config
    device: str
    pinned: bool
    timing: str  # what the µs are: "idle-start latency (cuda-events)" or "wall-clock (cpu)"
    rounds: int
    cases: list[TransferCase]

    def to_document(self, ignored_keys: Sequence[str] = ()) -> dict:
        return envelope("bench-one-batch", {
            "tree_cache": "hiradix", "device": self.device, "pinned_host_memory": self.pinned,
            "timing": self.timing, "rounds": self.rounds,
            "definition": "GB/s = K and V bytes of the batch's prompt (all layers) / median time; share = the"
                          " bandwidth over the plain copy of the same bytes in the same direction, same run",
            "cases": [c.to_dict() for c in self.cases], "ignored_keys": list(ignored_keys)}, self.config)


def transfer_config(config: Config, case: Case) -> Config:
    """The case's stack: hiradix over a materialized KV pool, both pools sized to the batch
    (a pinned host pool as large as the configured device pool could exhaust host memory)."""
    tokens = case.batch_size * align_up(case.input_len, case.page_size)
    pool = tokens + case.page_size
    return replace(config, memory={"page_size": case.page_size, "kv_pool": "materialized", "max_total_tokens": pool,
                                   "kv_budget_gib": None, "max_context_len": min(config.memory.max_context_len, pool)},
                   cache={"kind": "hiradix", "host_size_gib": None, "host_ratio": 1.0},
                   semantics={"host_pool_floor": "any"})


def run_transfer_bench(config: Config, cases: Sequence[Case], repeat: int, warmup: int, rounds: int,
                       progress: Optional[Callable[[int, int, Case], None]] = None) -> TransferBench:
    """Time every case's copies `rounds` times; raises `CapacityError` when a batch's KV cannot
    be held twice (device and host) on the device.

    Unlike the memory-path cases, the rounds of one case run back to back: each case pins a
    host pool and a plain-copy buffer as large as its batch's KV (gigabytes for the larger
    batches), and pinning costs seconds, while a copy of megabytes or more is barely touched
    by host noise. The case's pinned memory is handed back to the system before the next."""
    device = resolve_device(config)
    samples: dict[Case, list[tuple[dict, int]]] = {case: [] for case in cases}
    pinned = False
    with torch_threads(device):
        for case in cases:
            cfg = transfer_config(config, case)
            stack = engines.get(cfg).build_stack(cfg)
            host = bench_host_pool(stack, device)
            for round_number in range(1, rounds + 1):
                if progress is not None:
                    progress(round_number, rounds, case)
                samples[case].append(_time_case(stack, host, case, device, repeat, warmup))
            pinned = host.pinned
            del stack, host
            _release_device_memory(device)
    results = []
    for case in cases:
        rows = samples[case]
        us = {p: statistics.median(r[0][p] for r in rows) for p in PHASES}
        tokens = case.batch_size * align_up(case.input_len, case.page_size)
        bpt = config.model.bytes_per_token
        results.append(TransferCase(case, tokens, tokens * bpt, us, rows[-1][1]))
    timing = "idle-start latency (cuda-events)" if device.type == "cuda" else "wall-clock (cpu)"
    return TransferBench(replace(config, cache={"kind": "hiradix"}), _describe(device), pinned, timing, rounds,
                         results)


def bench_host_pool(stack, device: torch.device) -> HostKVPool:
    """The stack's host pool, with K/V buffers (pinned on a GPU) also on a CPU, where a replay
    stack keeps indices only."""
    host = stack.host_pool
    if host.materialized:
        return host
    return HostKVPool(host.size, host.page_size, host.num_layers, host.num_kv_heads, host.head_dim,
                      stack.config.model.dtype, materialized=True, pin_memory=device.type == "cuda")


def _release_device_memory(device: torch.device) -> None:
    """Give cached device blocks and cached pinned host blocks back (the next case's are sized anew)."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
    if host_empty_cache is not None:
        host_empty_cache()


def _time_case(stack, host: HostKVPool, case: Case, device: torch.device, repeat: int,
               warmup: int) -> tuple[dict, int]:
    kv = stack.kv_pool
    per_req = align_up(case.input_len, case.page_size)
    slots = [stack.allocator.alloc(per_req) for _ in range(case.batch_size)]
    if any(s is None for s in slots):
        raise CapacityError(f"{case.label}: the device pool cannot hold the batch's {case.batch_size * per_req} tokens",
                            "use smaller --batch-size or --input-len")
    device_slots = torch.cat(slots)
    host_slots = host.alloc(len(device_slots))
    for buf in (kv.k_buffer, kv.v_buffer):
        buf.normal_()
    # The plain copy moves the same bytes (K and V) between one device and one pinned host tensor.
    num_bytes = len(device_slots) * kv.bytes_per_token
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=host.pinned)
    want = kv.k_buffer[:, device_slots[:8]].transpose(0, 1).clone()
    phases = {
        "backup": lambda: host.backup_from_device(kv, device_slots, host_slots),
        "load_back": lambda: host.load_to_device(kv, host_slots, device_slots),
        "plain_d2h": lambda: dst.copy_(src, non_blocking=host.pinned),
        "plain_h2d": lambda: src.copy_(dst, non_blocking=host.pinned),
    }
    timings: dict[str, Timing] = {}
    for name, fn in phases.items():
        # No queued device-time samples: backup and load-back read their slot indices on the
        # host (a synchronisation), which would wait for the spin queued ahead of them. Each
        # copy moves megabytes or more, so the idle-start latency is within a few percent of
        # the device time, and the plain copies are timed the same way.
        timings[name] = time_call(fn, device, repeat, warmup, device_time=False)
        if name == "backup":
            _check_copy(host.k_buffer[host_slots[:8]], want, "the host copy differs from the device K/V it backed up")
        elif name == "load_back":
            _check_copy(kv.k_buffer[:, device_slots[:8]].transpose(0, 1), want,
                        "the device K/V after the load-back differs from what was backed up")
    num_runs = len(runs(host_slots))
    stack.allocator.free(device_slots)
    host.free(host_slots)
    return {name: t.median_us for name, t in timings.items()}, num_runs


def _check_copy(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The timed copies are the real ones: the first slots' K must have arrived."""
    if want.device.type == "cuda":
        torch.cuda.synchronize(want.device)
    if not torch.equal(got.to(want.device), want):
        raise AssertionError(f"hiradix bench: {what}")


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu (one torch thread; both pools in host memory)"
