"""The config tree: YAML in, frozen dataclasses out.

Every YAML key is exactly a dataclass field name. Unknown keys, wrong types and impossible
sizes raise `ConfigError` naming the dotted key, the value and the valid choices.
`memory.page_size` is the only page size in the whole stack; every component receives it
from here (see `memcli.stack`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
import math
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, Literal, NamedTuple, Optional, Union, get_args, get_origin

import yaml

from memcli.errors import ConfigError
from memcli.mem_cache.pages import align_down

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
GIB = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the attention KV cache (no weights are ever loaded)."""

    num_layers: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: Literal["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"] = "bfloat16"

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class MemoryConfig:
    """Pool sizes. `max_total_tokens` and `kv_budget_gib` are alternatives (one must be set)."""

    page_size: int = 1
    max_total_tokens: Optional[int] = 16384
    kv_budget_gib: Optional[float] = None
    max_running_requests: int = 64
    max_context_len: int = 4096
    kv_pool: Literal["materialized", "indices"] = "materialized"
    need_sort: bool = False
    debug: bool = False


@dataclass(frozen=True)
class CacheConfig:
    """Prefix cache in front of the allocator."""

    kind: Literal["radix", "hiradix", "chunk", "none"] = "radix"
    # belady is offline (the trace's future uses; replay, radix only), a memcli extension SGLang does not have.
    eviction_policy: Literal["lru", "lfu", "fifo", "belady"] = "lru"
    kv_events: bool = False
    # hiradix only (SGLang's --enable-hierarchical-cache): a host-memory tier behind the tree.
    host_ratio: float = 2.0  # host pool size as a multiple of the device pool (--hicache-ratio)
    host_size_gib: Optional[float] = None  # host pool in GiB; overrides host_ratio (--hicache-size)
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = "write_through"
    load_back_threshold: int = 10  # host-only prefixes shorter than this (tokens) are recomputed

    def host_pool_tokens(self, device_tokens: int, bytes_per_token: int, page_size: int) -> int:
        """Host pool slots: `host_size_gib` of K/V, else `host_ratio` x the device pool,
        rounded down to a page multiple (SGLang's HostKVCache)."""
        if self.host_size_gib is not None:
            tokens = int(self.host_size_gib * GIB // bytes_per_token)
        else:
            tokens = int(device_tokens * self.host_ratio)
        return align_down(tokens, page_size)


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission and batching."""

    chunked_prefill_size: Optional[int] = 1024
    max_prefill_tokens: int = 4096
    policy: Literal["fcfs", "lpm", "priority"] = "fcfs"  # priority: vLLM's only
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    retract_decode_steps: int = 20
    max_new_tokens_clip: int = 4096
    # vLLM's names, read by the vllm-0.33 engine (null: vLLM 0.33's default; see VLLM_ONLY_KEYS).
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: Optional[int] = None
    long_prefill_token_threshold: Optional[int] = None


@dataclass(frozen=True)
class SimConfig:
    """Cost model of the simulated forward step (milliseconds on the simulated clock).

    step_ms = step_base_ms + prefill_token_us * new_tokens / 1000
              + decode_req_us * decode_reqs / 1000 + kv_read_ns * kv_tokens_read / 1e6
    """

    step_base_ms: float = 5.0
    prefill_token_us: float = 40.0
    decode_req_us: float = 50.0
    kv_read_ns: float = 20.0
    # hiradix transfers between device and host pools (one copy engine each way):
    # a copy of b bytes takes host_latency_us + b / host_bandwidth_gbps.
    host_bandwidth_gbps: float = 40.0
    host_latency_us: float = 10.0


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how the stack runs."""

    device: Literal["auto", "cuda", "cpu"] = "auto"
    kernel_backend: Literal["auto", "triton", "torch"] = "auto"
    # The memory path's CUDA-graph replays: the decode step (`mem_cache.decode_graph`), the
    # extend (`mem_cache.extend_graph`) and the free of rows (`mem_cache.free_graph`); auto
    # (with CUDA and the triton backend), true (needs both) or false (one launch each).
    decode_graph: Union[Literal["auto"], bool] = "auto"
    seed: int = 0


PROFILES = ("sglang-0.5.5", "memcli", "sglang-0.5.23")


@dataclass(frozen=True)
class SemanticsConfig:
    """Which stack the replay describes: SGLang 0.5.5 or 0.5.23 step for step, or memcli's improvements.

    `profile` picks a value for every behaviour below; a behaviour set here (not null)
    overrides the profile's choice. `PROFILE_CHOICES` gives each profile's values, and
    docs/FIDELITY.md what each one does and why the profiles differ.
    """

    # The engine the stack reproduces (`memcli.engines`; an unknown name is refused with the list).
    engine: str = "sglang-0.5.23"
    # An engine's own profile carries its name; `--engine NAME` selects it too (cli.options.with_engine).
    profile: Literal["sglang-0.5.5", "memcli", "sglang-0.5.23"] = "sglang-0.5.23"
    # Eviction when the free list is short: evict the whole need, or only the shortfall.
    evict_amount: Optional[Literal["full_need", "shortfall"]] = None
    # Pages an extend batch is assumed to open before evicting: one extra per request, or the exact count.
    page_estimate: Optional[Literal["one_per_request", "exact"]] = None
    # A node split: the cut-off tail keeps the access time the walk just gave it, and the new
    # upper node is stamped fresh (refresh); or both keep the node's old times (keep).
    split_stamp: Optional[Literal["refresh", "keep"]] = None
    # Hit counts for LFU: never counted (SGLang 0.5.5's radix cache: LFU orders as LRU), counted
    # per match (count), or once per request on each node its insert walks past what it had
    # already inserted (insert: SGLang 0.5.23).
    lfu_hits: Optional[Literal["never", "count", "insert"]] = None
    # Access and creation stamps: a logical clock that ticks at every stamp (one reading per
    # node, in the reference's order), or the simulated clock (one time per operation).
    lru_clock: Optional[Literal["logical", "simulated"]] = None
    # Retracted requests rejoin the waiting queue at its back, or at its front.
    retract_requeue: Optional[Literal["back", "front"]] = None
    # After a retraction the running batch keeps the victim-sort order, or its original order.
    retract_batch_order: Optional[Literal["victim_sort", "original"]] = None
    # A retracted request frees its aligned part and its partial last page in two calls (the
    # last page freed is handed out first), or everything in one call.
    retract_free: Optional[Literal["two_calls", "one_call"]] = None
    # A non-final prefill chunk goes into the tree, and gives back its request row, at the
    # start of the next step (deferred), or in the step's own result processing, keeping its row.
    # deferred_row_kept (SGLang 0.5.23): deferred, and the request keeps its row between pieces.
    chunked_prefix: Optional[Literal["deferred", "immediate", "deferred_row_kept"]] = None
    # When new requests are admitted: SGLang's `batch_is_full` flag (set when the pool or the
    # request limit is reached, cleared only when a batch shrinks) or a fresh budget every step.
    # batch_is_full_relaxed (SGLang 0.5.23): the flag also clears when the running batch is
    # empty or loses finished requests (filtered every step); NO_TOKEN sets it only when
    # something runs or was admitted.
    admission_gate: Optional[Literal["batch_is_full", "every_step", "batch_is_full_relaxed"]] = None
    # The next piece of a chunked request: as long as the budget allows, or floored to a page.
    chunk_alignment: Optional[Literal["unaligned", "page"]] = None
    # The chunk cache's protected size: the prefix tokens of running requests, or zero.
    chunk_cache_protected: Optional[Literal["counted", "zero"]] = None
    # bench-one-batch's decode steps: output_len - 1 (the prefill samples the first token) or output_len.
    bench_decode_steps: Optional[Literal["output_len_minus_1", "output_len"]] = None
    # The scheduler loop: SGLang's `event_loop_overlap` (batch N+1 is launched before the
    # result of batch N is processed: finishes, frees and the tree update come one iteration
    # late) or `event_loop_normal` (each batch's result is processed before the next is built).
    event_loop: Optional[Literal["overlap", "normal", "async", "sync"]] = None  # async/sync: vLLM's loops
    # hiradix: the host pool must be larger than the device pool (SGLang asserts it; a write-back
    # then always finds room), or any size (a node that finds no host room is dropped instead).
    host_pool_floor: Optional[Literal["above_device", "any"]] = None
    # hiradix: finished host copies are acknowledged (their nodes unlocked) only when a prefill
    # batch is tried (SGLang's check_hicache_events in get_new_batch_prefill), or every step.
    hicache_ack: Optional[Literal["prefill_attempt", "every_step"]] = None
    # Request lengths: SGLang's limits (max_req_len = min(context, pool) - 1; a request's output
    # is clipped to max_req_len - input - 1 at arrival, a prompt of max_req_len - 5 tokens or
    # more is aborted), or row (a request fits when input + output fits a request row).
    # memory_clip (SGLang 0.5.23): max_req_len, then also max_new <= pool - ceil_page(input) - page - 1.
    request_limits: Optional[Literal["max_req_len", "row", "memory_clip"]] = None
    # -- keys of SGLang 0.5.23 (ENGINE_KEYS: only that engine reads them) --------------------
    # A finished request's insert: one leaf for prompt + output (none), or the prompt inserted
    # again right after, so the leaf splits at the page-aligned prompt end (prompt).
    prompt_split: Optional[Literal["none", "prompt"]] = None
    # FCFS under lru: nothing (off), or the prefixes of the first 128 waiting requests touched
    # in the LRU, head last, on the first and every 32nd ordering (touch).
    waiting_prefix_refresh: Optional[Literal["off", "touch"]] = None
    # Admission: no reserve (none), or one page per admitted request in the pool check and
    # in the budget it charges (page: SGLang 0.5.23's PrefillBudget).
    admission_reserve: Optional[Literal["none", "page"]] = None
    # A request longer than the input budget: stopped even with chunked prefill (stop), or
    # chunked to the chunk budget (chunk; the stop stays without chunked prefill).
    rem_input_gate: Optional[Literal["stop", "chunk"]] = None
    # The next piece of a chunked request with no budget left: not scheduled (budget), or a
    # whole chunk (full_chunk: the piece must progress to free its KV).
    chunk_progress: Optional[Literal["budget", "full_chunk"]] = None
    # Request rows: from the head of the free list, rows 0..n-1 (fifo), or from its tail,
    # rows 1..n with row 0 reserved for padding (lifo_row0).
    row_order: Optional[Literal["fifo", "lifo_row0"]] = None
    # Paged frees of tree evictions, insert duplicates and releases: the pages sorted and
    # de-duplicated (sorted), or one slot per page in row order (row: 0.5.23's free_segment).
    free_order: Optional[Literal["sorted", "row"]] = None
    # The tree's stamps: SGLang 0.5.5's RadixCache (radix: every node a match passes is
    # stamped as it is walked; a split's upper node is new) or 0.5.23's UnifiedTreeCore
    # (unified: a match stamps its path once at the end, the deepest node newest; a split's
    # upper node keeps the creation time and hits, its tail is restamped).
    tree_stamps: Optional[Literal["radix", "unified"]] = None
    # Overlap loop: a request its in-flight result finishes by length is decoded once more
    # (decode), or left out of the decode, which is skipped instead of retracting when memory
    # is short while such requests exist (skip: 0.5.23's _reqs_finishing_inflight).
    skip_finishing_decode: Optional[Literal["decode", "skip"]] = None
    # Overlap loop: a released request's slot allocated by a batch in flight is freed when that
    # batch's result comes (lagging: 0.5.5), or with the rest of its row at once (committed:
    # 0.5.23 counts the slot committed when it is allocated, PR #12224).
    overlap_release: Optional[Literal["lagging", "committed"]] = None
    # Admission's reserve for a running request of the trace marked `ignore_eos`: its remaining
    # output times the new-token ratio (ratio: 0.5.5), or whole (one: 0.5.23's
    # _get_running_request_total_token_offset; such a request cannot finish early).
    ignore_eos_ratio: Optional[Literal["ratio", "one"]] = None
    # Overlap loop, a request finishing on EOS (traces with max_new_tokens > output_len): its
    # finished insert takes input + output - 1 tokens (none: 0.5.5), or also the token of the
    # decode in flight (one: 0.5.23 commits a slot when it is allocated; with
    # overlap_release: committed only).
    eos_extra_insert: Optional[Literal["none", "one"]] = None
    # A prefill batch's result: its frees (duplicate prefix pages an insert gives back) go to
    # the allocator one by one (none: 0.5.5), or gathered and freed once at its end (grouped:
    # 0.5.23's process_batch_result_prefill, free_group_begin/end). Paged, the free list's
    # order differs, so which pages the next allocation takes.
    prefill_free_group: Optional[Literal["none", "grouped"]] = None
    # Host tier, a copy short of room (a load-back on the device, a backup on the host): evict
    # the whole copy's size after a failed allocation (full_need: 0.5.5's HiRadixCache), or the
    # shortfall first, failing when that does not free it (shortfall: 0.5.23's
    # _load_back_transfers -> evict_for_alloc, _execute_kv_backup -> evict_host).
    hicache_evict: Optional[Literal["full_need", "shortfall"]] = None
    # Host tier: the host pool is host_ratio x the device pool in whole pages (none: 0.5.5), plus
    # one padding page (page: 0.5.23's pool_host/base.py).
    host_pool_padding: Optional[Literal["none", "page"]] = None
    # Host tier under write_back, an eviction: the nodes written back give up their device slots
    # after the whole walk (batched: 0.5.5), or each right after its copy (per_node: 0.5.23's
    # _evict_components, backup then demote); the order of frees differs.
    write_back_demote: Optional[Literal["batched", "per_node"]] = None
    # Host tier under write_back, host pressure: evict host-only leaves (leaves: 0.5.5), or first
    # free the host copies of nodes also on the device, oldest duplicate first, sparing evictable
    # device leaves in a first pass (duplicates_first: 0.5.23's _reclaim_full_host_duplicates).
    write_back_host_reclaim: Optional[Literal["leaves", "duplicates_first"]] = None

    def resolved(self) -> "SemanticsConfig":
        """The same section with every behaviour set: the override where one is set, else the
        profile's value. What each component is built with."""
        return dataclasses.replace(self, **{key: PROFILE_CHOICES[key][self.profile] for key in PROFILE_CHOICES
                                            if getattr(self, key) is None})

    def overrides(self) -> dict[str, str]:
        """The behaviours set apart from the profile (equal values included: the user asked)."""
        return {key: getattr(self, key) for key in PROFILE_CHOICES if getattr(self, key) is not None}

    @property
    def label(self) -> str:
        """`sglang-0.5.5`, or with overrides `memcli + split_stamp=refresh, lfu_hits=never`."""
        if self.engine in ENGINE_DEFAULTS:  # not an SGLang profile: the engine and its loop
            return f"{self.engine} ({self.event_loop or 'async'} loop)"
        extra = ", ".join(f"{k}={v}" for k, v in self.overrides().items())
        return f"{self.profile} + {extra}" if extra else self.profile


# Each behaviour's value under each profile.
PROFILE_CHOICES: dict[str, dict[str, str]] = {
    "evict_amount": {"sglang-0.5.5": "full_need", "memcli": "shortfall"},
    "page_estimate": {"sglang-0.5.5": "one_per_request", "memcli": "exact"},
    "split_stamp": {"sglang-0.5.5": "refresh", "memcli": "keep"},
    "lfu_hits": {"sglang-0.5.5": "never", "memcli": "count"},
    "lru_clock": {"sglang-0.5.5": "logical", "memcli": "simulated"},
    "retract_requeue": {"sglang-0.5.5": "back", "memcli": "front"},
    "retract_batch_order": {"sglang-0.5.5": "victim_sort", "memcli": "original"},
    "retract_free": {"sglang-0.5.5": "two_calls", "memcli": "one_call"},
    "chunked_prefix": {"sglang-0.5.5": "deferred", "memcli": "immediate"},
    "admission_gate": {"sglang-0.5.5": "batch_is_full", "memcli": "every_step"},
    "chunk_alignment": {"sglang-0.5.5": "unaligned", "memcli": "page"},
    "chunk_cache_protected": {"sglang-0.5.5": "counted", "memcli": "zero"},
    "bench_decode_steps": {"sglang-0.5.5": "output_len_minus_1", "memcli": "output_len"},
    "event_loop": {"sglang-0.5.5": "overlap", "memcli": "normal"},
    "host_pool_floor": {"sglang-0.5.5": "above_device", "memcli": "any"},
    "hicache_ack": {"sglang-0.5.5": "prefill_attempt", "memcli": "every_step"},
    "request_limits": {"sglang-0.5.5": "max_req_len", "memcli": "row"},
    "prompt_split": {"sglang-0.5.5": "none", "memcli": "none"},
    "waiting_prefix_refresh": {"sglang-0.5.5": "off", "memcli": "off"},
    "admission_reserve": {"sglang-0.5.5": "none", "memcli": "none"},
    "rem_input_gate": {"sglang-0.5.5": "stop", "memcli": "stop"},
    "chunk_progress": {"sglang-0.5.5": "budget", "memcli": "budget"},
    "row_order": {"sglang-0.5.5": "fifo", "memcli": "fifo"},
    "free_order": {"sglang-0.5.5": "sorted", "memcli": "sorted"},
    "tree_stamps": {"sglang-0.5.5": "radix", "memcli": "radix"},
    "skip_finishing_decode": {"sglang-0.5.5": "decode", "memcli": "decode"},
    "overlap_release": {"sglang-0.5.5": "lagging", "memcli": "lagging"},
    "ignore_eos_ratio": {"sglang-0.5.5": "ratio", "memcli": "ratio"},
    "eos_extra_insert": {"sglang-0.5.5": "none", "memcli": "none"},
    "prefill_free_group": {"sglang-0.5.5": "none", "memcli": "none"},
    "hicache_evict": {"sglang-0.5.5": "full_need", "memcli": "full_need"},
    "host_pool_padding": {"sglang-0.5.5": "none", "memcli": "none"},
    "write_back_demote": {"sglang-0.5.5": "batched", "memcli": "batched"},
    "write_back_host_reclaim": {"sglang-0.5.5": "leaves", "memcli": "leaves"},
}
# SGLang 0.5.23's values (docs/FIDELITY.md; the reference page's sections in brackets).
SGLANG_0523_CHOICES: dict[str, str] = {
    "evict_amount": "shortfall",  # evict_to_free_tokens [2.1]
    "page_estimate": "one_per_request",
    "split_stamp": "refresh",  # the tail is restamped [2.3]
    "lfu_hits": "insert",  # _inc_hit_count_and_check [2.3]
    "lru_clock": "logical",  # SGLang's own logical counter [2.3]
    "retract_requeue": "back",
    "retract_batch_order": "victim_sort",
    "retract_free": "one_call",  # release_kv_cache [2.6]
    "chunked_prefix": "deferred_row_kept",  # stash_chunked_request [2.9]
    "admission_gate": "batch_is_full_relaxed",  # get_next_batch_to_run's filter [2.9]
    "chunk_alignment": "unaligned",
    "chunk_cache_protected": "zero",
    "bench_decode_steps": "output_len_minus_1",
    "event_loop": "overlap",
    "host_pool_floor": "any",  # a warning [2.5]
    "hicache_ack": "every_step",  # _process_hicache_events [2.5]
    "request_limits": "memory_clip",  # max_new_tokens_for_memory [2.10]
    "prompt_split": "prompt",  # checkpoint_into_tree [2.3]
    "waiting_prefix_refresh": "touch",  # _touch_waiting_prefixes [2.8]
    "admission_reserve": "page",  # PrefillBudget.reserve [2.8]
    "rem_input_gate": "chunk",  # _select_prefill_admission [2.8]
    "chunk_progress": "full_chunk",  # available_chunk_tokens [2.8]
    "row_order": "lifo_row0",  # ReqToTokenPool [2.2]
    "free_order": "row",  # free_segment [2.1]
    "tree_stamps": "unified",  # UnifiedTreeCore [2.3]
    "skip_finishing_decode": "skip",  # _reqs_finishing_inflight [2.9]
    "overlap_release": "committed",  # release_kv_cache, kv_committed_len [2.6, 2.9]
    "ignore_eos_ratio": "one",  # PrefillAdder._get_running_request_total_token_offset [2.8]
    "prefill_free_group": "grouped",  # batch_result_processor.py: process_batch_result_prefill
    "eos_extra_insert": "one",  # release_kv_cache: owned_kv_len = min(committed, input + output) [2.9]
    "hicache_evict": "shortfall",  # _load_back_transfers, _execute_kv_backup [2.5]
    "host_pool_padding": "page",  # HostKVCache.__init__: page_num = size // ps + 1 [2.5]
    "write_back_demote": "per_node",  # UnifiedRadixCache._evict_components [2.5]
    "write_back_host_reclaim": "duplicates_first",  # UnifiedTreeCore.drive_host_eviction [2.5]
}
for _key, _value in SGLANG_0523_CHOICES.items():
    PROFILE_CHOICES[_key]["sglang-0.5.23"] = _value
# Keys only some engines read: a document of another engine leaves them out while unset.
ENGINE_KEYS: dict[str, tuple[str, ...]] = {
    key: ("sglang-0.5.23",) for key in ("prompt_split", "waiting_prefix_refresh", "admission_reserve",
                                         "rem_input_gate", "chunk_progress", "row_order", "free_order",
                                         "tree_stamps", "skip_finishing_decode", "overlap_release",
                                         "ignore_eos_ratio", "eos_extra_insert", "prefill_free_group",
                                         "hicache_evict", "host_pool_padding",
                                         "write_back_demote", "write_back_host_reclaim")
}


def engine_reads(key: str, engine: str) -> bool:
    """Whether `engine` reads the semantics key `key` (every engine reads the shared keys)."""
    return engine in ENGINE_KEYS.get(key, (engine,))


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    semantics: SemanticsConfig = field(default_factory=SemanticsConfig)

    @property
    def page_size(self) -> int:
        return self.memory.page_size

    @functools.cached_property
    def behaviour(self) -> SemanticsConfig:
        """The profile's behaviours with the overrides applied (resolved once per config: the
        config is frozen, and the limits read it for every request of a trace)."""
        return self.semantics.resolved()

    @property
    def requested_total_tokens(self) -> int:
        """Pool size asked for, in tokens, before rounding to pages."""
        if self.memory.max_total_tokens is not None:
            return self.memory.max_total_tokens
        return int(self.memory.kv_budget_gib * GIB // self.model.bytes_per_token)

    @property
    def pool_size(self) -> int:
        """Usable KV slots: the requested size rounded down to a page multiple."""
        return align_down(self.requested_total_tokens, self.page_size)

    @property
    def max_req_len(self) -> Optional[int]:
        """SGLang's longest request, `min(context_len - 1, max_total_num_tokens - 1)`, under
        `semantics.request_limits: max_req_len`; None under `row` (no such limit)."""
        if self.behaviour.request_limits not in SGLANG_LIMITS:
            return None
        return min(self.memory.max_context_len, self.pool_size) - 1

    def context_need(self, input_len: int, output_len: int) -> int:
        """The shortest `memory.max_context_len` (and pool) that runs a request whole: under
        SGLang's request limits, input + output two tokens under the context and the prompt
        `REQ_INPUT_MARGIN` + 1 under max_req_len; else input + output (one request row)."""
        if self.behaviour.request_limits in SGLANG_LIMITS:
            return max(input_len + output_len + 2, input_len + REQ_INPUT_MARGIN + 2)
        return input_len + output_len

    @property
    def req_to_token_cols(self) -> int:
        """Columns of req_to_token: the context plus a few spare positions."""
        return self.memory.max_context_len + 4

    def to_dict(self) -> dict[str, Any]:
        """Every key, except the unset semantics keys that the config's engine does not read
        and vLLM's own keys while unset (documents of other engines stay as they were)."""
        out = dataclasses.asdict(self)
        engine = self.semantics.engine
        out["semantics"] = {k: v for k, v in out["semantics"].items() if v is not None or engine_reads(k, engine)}
        for key in VLLM_ONLY_KEYS:
            section, name = key.split(".")
            if out[section][name] is None:
                del out[section][name]
        return out


# An engine's own defaults for keys memcli's config leaves at a value that engine lacks:
# {engine: {key: (memcli's value, the engine's)}}. vLLM has no token granularity (page_size 1
# is read as its default block size 16) and bounds a request by max_model_len alone (row).
ENGINE_DEFAULTS = {"vllm-0.33": {"memory.page_size": (1, 16), "semantics.request_limits": (None, "row")}}

# Engines with vLLM's priority policy (scheduler.policy=priority, the trace's `priority` field).
PRIORITY_ENGINES = ("vllm-0.33",)

# Keys only the vllm-0.33 engine reads; left out of `Config.to_dict` while null.
VLLM_ONLY_KEYS = ("scheduler.max_num_batched_tokens", "scheduler.max_num_seqs", "scheduler.long_prefill_token_threshold")


# The request_limits values that apply SGLang's max_req_len (memory_clip clips further).
SGLANG_LIMITS = ("max_req_len", "memory_clip")
# SGLang aborts a prompt of `max_req_len - REQ_INPUT_MARGIN` tokens or more (max_req_input_len).
REQ_INPUT_MARGIN = 5

SECTIONS = {f.name: f.type for f in fields(Config)}


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in SECTIONS}


def _describe(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return tp.__name__


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in get_args(tp):
            try:
                return _coerce(path, value, arg)
            except ConfigError:
                continue
        raise _type_error(path, value, tp)
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise _type_error(path, value, tp)
    if tp is type(None):
        if value is None:
            return None
        raise _type_error(path, value, tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(path, value, tp)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(path, value, tp)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(path, value, tp)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer beyond any float
                raise _type_error(path, value, tp) from None
        raise _type_error(path, value, tp)
    raise _type_error(path, value, tp)


def _type_error(path: str, value: Any, tp: Any) -> ConfigError:
    return ConfigError(f"{path}: invalid value {value!r}", hint=f"{path} must be {_describe(tp)}")


# Keys that were part of the schema once: still unknown keys (a config error naming them),
# with a hint that says why they went and what to do instead.
RETIRED_KEYS = {
    "sim.write_kv": "sim.write_kv was retired: the simulated forward step never wrote K/V"
                    " (bench-one-batch times real K/V stores); delete the key",
}


def _build_section(name: str, cls: type, raw: Any) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: expected a mapping, got {raw!r}", hint=f"write {name}: as a section of keys")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in fields(cls)]
    values = {}
    for key, value in raw.items():
        path = f"{name}.{key}"
        if key not in hints:
            hint = RETIRED_KEYS.get(path, f"valid keys of {name}: {', '.join(valid)}")
            raise ConfigError(f"unknown config key {path!r}", hint=hint)
        values[key] = _coerce(path, value, hints[key])
    return cls(**values)


def config_from_dict(raw: Any, source: str = "config") -> Config:
    """Build and validate a `Config` from a parsed YAML mapping."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections", hint=f"sections: {', '.join(SECTIONS)}")
    classes = _section_classes()
    for key in raw:
        if key not in classes:
            raise ConfigError(f"unknown config section {key!r} in {source}", hint=f"valid sections: {', '.join(SECTIONS)}")
    sections = {name: _build_section(name, cls, raw.get(name)) for name, cls in classes.items()}
    sections["semantics"] = _profile_of_engine(sections["semantics"])
    for key, (unset, value) in ENGINE_DEFAULTS.get(sections["semantics"].engine, {}).items():
        section, name = key.split(".")
        if getattr(sections[section], name) == unset:
            sections[section] = dataclasses.replace(sections[section], **{name: value})
    config = Config(**sections)
    validate(config)
    return config


def _profile_of_engine(semantics: SemanticsConfig) -> SemanticsConfig:
    """An engine's own profile follows the engine: with `engine: sglang-0.5.23`, a profile
    naming another engine (`sglang-0.5.5`, as the built-in configs say) becomes the engine's;
    `memcli` (and an engine without a profile of its own) is kept."""
    engine, profile = semantics.engine, semantics.profile
    if engine in PROFILES and profile not in ("memcli", engine):
        return dataclasses.replace(semantics, profile=engine)
    return semantics


class Range(NamedTuple):
    """Allowed values of a numeric key: `low <= v` (`low < v` when `low_open`), `v <= high`;
    floats must also be finite."""

    low: float
    high: Optional[float] = None
    low_open: bool = False

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)

    def describe(self) -> str:
        kind = "an integer" if isinstance(self.low, int) else "a finite number"
        if self.high is None:
            return f"{kind} {'>' if self.low_open else '>='} {_num(self.low)}"
        return f"{kind} in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


SIZE, COUNT, COST, RATIO = Range(1), Range(0), Range(0.0), Range(0.0, 1.0)
# Every numeric key and what it may hold (null, where allowed, is not checked here).
RANGES: dict[str, Range] = {
    "model.num_layers": SIZE, "model.num_kv_heads": SIZE, "model.head_dim": SIZE,
    "memory.page_size": SIZE, "memory.max_total_tokens": SIZE, "memory.kv_budget_gib": Range(0.0, 2.0**30, low_open=True),
    "memory.max_running_requests": SIZE, "memory.max_context_len": Range(2),
    "scheduler.max_prefill_tokens": SIZE,  # chunked_prefill_size: a page multiple, checked in `validate`
    "scheduler.init_new_token_ratio": RATIO, "scheduler.min_new_token_ratio_factor": RATIO,
    "scheduler.new_token_ratio_decay_steps": COUNT, "scheduler.retract_decode_steps": COUNT,
    "scheduler.max_new_tokens_clip": SIZE,
    "scheduler.max_num_batched_tokens": SIZE, "scheduler.max_num_seqs": SIZE, "scheduler.long_prefill_token_threshold": COUNT,
    "sim.step_base_ms": COST, "sim.prefill_token_us": COST, "sim.decode_req_us": COST, "sim.kv_read_ns": COST,
    "sim.host_bandwidth_gbps": Range(0.0, 1e6, low_open=True), "sim.host_latency_us": COST,
    "cache.host_ratio": Range(0.0, 1024.0, low_open=True), "cache.host_size_gib": Range(0.0, 2.0**30, low_open=True),
    "cache.load_back_threshold": COUNT,
    "runtime.seed": Range(0, 2**63 - 1),
}


def check_ranges(config: Config) -> None:
    """Raise `ConfigError` for the first numeric key out of its `RANGES` entry (NaN and
    infinities included), naming the key, the value and the range."""
    for key, allowed in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value is not None and not allowed.contains(value):
            raise ConfigError(f"{key}: invalid value {value!r}", hint=f"{key} must be {allowed.describe()}")


def validate(config: Config) -> None:
    """Reject impossible values; every message names the key, the value and the fix."""
    mem = config.memory
    if (mem.max_total_tokens is None) == (mem.kv_budget_gib is None):
        raise ConfigError(
            "memory: set exactly one of max_total_tokens and kv_budget_gib",
            hint="for example max_total_tokens: 16384 and kv_budget_gib: null",
        )
    ps = mem.page_size
    if ps < 1 or ps & (ps - 1):
        raise ConfigError(f"memory.page_size: invalid value {ps}", hint="page_size must be a power of two (1, 2, 4, ..., 64, 128)")
    check_ranges(config)
    key = "max_total_tokens" if mem.max_total_tokens is not None else "kv_budget_gib"
    if config.pool_size < ps:
        raise ConfigError(
            f"memory.{key}: the pool holds {config.requested_total_tokens} tokens, less than one page of {ps}",
            hint=f"raise memory.{key} to at least {ps} tokens or lower memory.page_size",
        )
    if mem.max_context_len > config.pool_size:
        raise ConfigError(
            f"memory.max_context_len: {mem.max_context_len} is longer than the pool ({config.pool_size} tokens)",
            hint=f"lower memory.max_context_len to at most {config.pool_size} or enlarge the pool ({key})",
        )
    sched = config.scheduler
    chunk = sched.chunked_prefill_size
    if chunk is not None and (chunk < ps or chunk % ps):
        raise ConfigError(
            f"scheduler.chunked_prefill_size: {sched.chunked_prefill_size} is not a positive multiple of page_size {ps}",
            hint=f"use a multiple of {ps}, for example {max(ps, align_down(sched.chunked_prefill_size, ps))}",
        )
    if config.cache.kind == "hiradix":
        _validate_host_pool(config)
    if sched.policy == "priority" and config.semantics.engine not in PRIORITY_ENGINES:
        raise ConfigError("scheduler.policy: priority is vLLM's policy; SGLang's are fcfs and lpm here",
                          hint="use --engine vllm-0.33 for priority scheduling, or scheduler.policy fcfs or lpm")


def host_pool_size(config: Config) -> int:
    """Slots of the hiradix host pool the config asks for (0 when the cache is not hiradix)."""
    if config.cache.kind != "hiradix":
        return 0
    padding = config.page_size if config.behaviour.host_pool_padding == "page" else 0
    return config.cache.host_pool_tokens(config.pool_size, config.model.bytes_per_token, config.page_size) + padding


def _validate_host_pool(config: Config) -> None:
    cache, size, ps = config.cache, config.pool_size, config.page_size
    if cache.kv_events:
        raise ConfigError("cache.kv_events: the hierarchical cache (cache.kind hiradix) records no KV events",
                          hint="set cache.kv_events=false, or use cache.kind=radix")
    host = host_pool_size(config)
    key = "cache.host_size_gib" if cache.host_size_gib is not None else "cache.host_ratio"
    if host < ps:
        raise ConfigError(f"{key}: the host pool holds {host} tokens, less than one page of {ps}",
                          hint=f"raise {key} (the device pool holds {size} tokens)")
    if config.behaviour.host_pool_floor == "above_device" and host <= size:
        raise ConfigError(
            f"{key}: the host pool ({host} tokens) must be larger than the device pool ({size} tokens) under"
            f" semantics.host_pool_floor=above_device (SGLang 0.5.5 asserts it)",
            hint=f"raise {key} above {_host_floor(config, key)}, or --set semantics.host_pool_floor=any")


def _host_floor(config: Config, key: str) -> str:
    if key == "cache.host_ratio":
        return "1.0 (for example 2.0, SGLang's default)"
    return f"{config.pool_size * config.model.bytes_per_token / GIB:.3g} GiB (the device pool's K/V)"


# Keys a command does not read, and why: set away from their default, the command says so
# (a `note:` line on stderr, `ignored_keys` in its JSON) instead of silently doing nothing.
# A section name stands for every key of the section.
IGNORED_BY: dict[str, dict[str, str]] = {
    "replay": {
        "runtime.seed": "token ids come from the trace",
    },
    "bench-one-batch": {
        "sim": "bench-one-batch times real work; the simulated clock is replay's",
        "scheduler": "static batches: no admission, chunking or retraction",
        "cache.kind": "--tree-cache picks the prefix cache",
    },
}


def ignored_keys(config: Config, command: str) -> dict[str, str]:
    """`{dotted key: why}` for the keys `command` ignores that are set away from their default."""
    out = {}
    defaults = Config()
    for entry, why in IGNORED_BY.get(command, {}).items():
        section, _, name = entry.partition(".")
        names = [name] if name else [f.name for f in fields(getattr(defaults, section))]
        for key in names:
            if getattr(getattr(config, section), key) != getattr(getattr(defaults, section), key):
                out[f"{section}.{key}"] = why
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """`memory.page_size=16` -> (["memory", "page_size"], 16); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key.path=value", hint="for example --set memory.page_size=16")
    path, _, raw_value = text.partition("=")
    keys = path.strip().split(".")
    if len(keys) != 2 or not all(keys):
        raise ConfigError(f"--set {text!r}: key must be section.key", hint=f"sections: {', '.join(SECTIONS)}")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else None
    except (yaml.YAMLError, ValueError, TypeError, RecursionError):  # not YAML: the string itself
        value = raw_value
    return keys, value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Return a copy of the raw mapping with each `key.path=value` applied."""
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in (raw or {}).items()}
    for text in overrides:
        (section, key), value = parse_override(text)
        if section not in SECTIONS:
            raise ConfigError(f"--set {text!r}: unknown config section {section!r}", hint=f"valid sections: {', '.join(SECTIONS)}")
        if merged.get(section) is None:
            # An empty section in YAML (`memory:`) parses as None.
            merged[section] = {}
        target = merged[section]
        if not isinstance(target, dict):
            raise ConfigError(f"--set {text!r}: {section} is not a section", hint=f"sections: {', '.join(SECTIONS)}")
        target[key] = value
    return merged


def read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}", hint="pass an existing YAML file to --config") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})", hint="pass a YAML text file to --config") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML", hint="check the indentation and the key: value syntax") from None
    except (ValueError, TypeError, RecursionError) as exc:  # a constructor's own error (dates, nesting)
        raise ConfigError(f"{path}: not valid YAML ({type(exc).__name__})", hint="check the values") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}", hint=f"sections: {', '.join(SECTIONS)}")
    return raw


def builtin_config_text(name: str = "default") -> str:
    return resources.files("memcli.configs").joinpath(f"{name}.yaml").read_text()


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                builtin: str = "default") -> Config:
    """Load a YAML config (the built-in `builtin` config when `path` is None) and apply overrides."""
    if path is None:
        raw, source = yaml.safe_load(builtin_config_text(builtin)) or {}, f"built-in {builtin} config"
    else:
        raw, source = read_yaml(Path(path)), str(path)
    return config_from_dict(apply_overrides(raw, list(overrides)), source=source)


def replace(config: Config, **sections: dict[str, Any]) -> Config:
    """A copy of `config` with some fields changed, validated again.

    `replace(cfg, memory={"page_size": 16})`.
    """
    raw = config.to_dict()
    for name, changes in sections.items():
        raw[name].update(changes)
    return config_from_dict(raw)
