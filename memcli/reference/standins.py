"""Minimal stand-ins for the SGLang modules that the memory stack imports but that cannot be
imported here (they pull in model code, distributed runtime, zmq, msgspec, CUDA libraries).

Each entry of `STANDINS` names a module, says in one line why the real one is replaced,
and builds the module's attributes. Stand-ins hold only what the extracted modules use at
import time or on the memory paths; anything else raises `StandInUsed` when called.

Where a stand-in needs a piece of SGLang's own logic (page arithmetic, enums), it does not
re-implement it: `borrow` executes those definitions from the real source file in the
extracted wheel.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import logging
import os
import types
import typing
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch


class StandInUsed(RuntimeError):
    """Code reached a part of SGLang that the reference loader replaced by a stand-in."""


class StandIn(NamedTuple):
    reason: str  # one line: why the real module is not imported
    build: Callable[[Path], dict]  # extracted root -> module attributes


def borrow(path: Path, names: tuple[str, ...], namespace: Optional[dict] = None) -> dict:
    """Execute the top-level functions and classes `names` of the real source file `path`.

    Only those definitions run (not the file's imports or other statements); `namespace`
    supplies the globals they refer to. Returns the namespace. Raises KeyError for a name
    the file does not define (the wheel changed).
    """
    tree = ast.parse(path.read_text(), str(path))
    defs = {node.name: node for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
    missing = [n for n in names if n not in defs]
    if missing:
        raise KeyError(f"{path} defines no {', '.join(missing)}")
    module = ast.Module(body=[defs[n] for n in names], type_ignores=[])
    ns = {"__name__": f"memcli_borrowed.{path.stem}", **_common_globals(), **(namespace or {})}
    exec(compile(module, str(path), "exec"), ns)
    return ns


def _common_globals() -> dict:
    typing_names = {n: getattr(typing, n) for n in ("Any", "Dict", "List", "Optional", "Tuple", "Union")}
    return {"os": os, "torch": torch, "logging": logging, "logger": logging.getLogger("sglang"),
            "lru_cache": functools.lru_cache, "total_ordering": functools.total_ordering, "IntEnum": enum.IntEnum, "Enum": enum.Enum,
            "auto": enum.auto, **typing_names}


def _unavailable(name: str) -> Callable[..., Any]:
    def call(*args, **kwargs):
        raise StandInUsed(f"{name} is a stand-in of the memcli reference loader; this code path is not supported")
    call.__name__ = name.rsplit(".", 1)[-1]
    return call


def _placeholder(name: str) -> type:
    """A class usable in annotations and isinstance checks; instantiating it raises."""
    def __init__(self, *args, **kwargs):
        raise StandInUsed(f"{name} is a stand-in of the memcli reference loader")
    return type(name.rsplit(".", 1)[-1], (), {"__init__": __init__, "__module__": name.rsplit(".", 1)[0]})


# -- builders ----------------------------------------------------------------------------

_UTILS_FUNCTIONS = ("is_cuda", "is_npu", "is_float4_e2m1fn_x2", "get_bool_env_var", "next_power_of_2",
                    "support_triton", "flatten_nested_list", "get_num_new_pages")


def _utils(root: Path) -> dict:
    ns = borrow(root / "sglang/srt/utils/common.py", _UTILS_FUNCTIONS, {"_warned_bool_env_var_keys": set()})
    return {name: ns[name] for name in _UTILS_FUNCTIONS}


@dataclasses.dataclass
class ServerArgs:
    """The server arguments the memory paths read. `attention_backend` picks the path of
    `mem_cache.common`'s `write_cache_indices` and `get_last_loc`: Triton kernels, or with
    "torch_native" SGLang's torch fallback (the only one the Triton interpreter runs: the
    Triton write path reads pointers out of a tensor). The loader sets the device's default
    (`memcli.reference.backends`)."""

    attention_backend: str = "torch_native"
    speculative_algorithm: Optional[str] = None
    disaggregation_mode: str = "null"
    schedule_low_priority_values_first: bool = False
    enable_deterministic_inference: bool = False
    page_size: int = 1


def _server_args(root: Path) -> dict:
    state = {"args": ServerArgs()}

    def set_global_server_args_for_scheduler(args: ServerArgs) -> None:
        state["args"] = args

    return {"ServerArgs": ServerArgs, "get_global_server_args": lambda: state["args"],
            "set_global_server_args_for_scheduler": set_global_server_args_for_scheduler,
            "set_global_server_args_for_tokenizer": set_global_server_args_for_scheduler}


def _kv_events(root: Path) -> dict:
    @dataclasses.dataclass
    class BlockStored:
        block_hashes: list
        parent_block_hash: Optional[int]
        token_ids: list
        block_size: int
        lora_id: Optional[int] = None

    @dataclasses.dataclass
    class BlockRemoved:
        block_hashes: list

    @dataclasses.dataclass
    class AllBlocksCleared:
        pass

    return {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}


def _forward_batch_info(root: Path) -> dict:
    ns = borrow(root / "sglang/srt/model_executor/forward_batch_info.py", ("ForwardMode", "CaptureHiddenMode"))
    return {"ForwardMode": ns["ForwardMode"], "CaptureHiddenMode": ns["CaptureHiddenMode"],
            "ForwardBatch": _placeholder("sglang.srt.model_executor.forward_batch_info.ForwardBatch")}


@dataclasses.dataclass
class TimeStats:
    """Request timestamps; the schedule policy sorts by `wait_queue_entry_time`."""

    disagg_mode: Any = None
    wait_queue_entry_time: float = 0.0
    forward_entry_time: float = 0.0
    completion_time: float = 0.0
    prefill_start_time: float = 0.0
    prefill_end_time: float = 0.0


class SamplingBatchInfo:
    """What `ScheduleBatch.prepare_for_extend/decode` build for sampling: nothing is sampled
    here, so it only records the batch size. `filter_batch`/`merge_batch` (called by the
    batch's own filter and merge) keep that count; no penalizer is ever required."""

    penalizer_orchestrator = types.SimpleNamespace(is_required=False)

    def __init__(self, batch_size: int):
        self.batch_size = batch_size

    @classmethod
    def from_schedule_batch(cls, batch: Any, vocab_size: int) -> "SamplingBatchInfo":
        return cls(len(batch.reqs))

    def filter_batch(self, keep_indices: list, keep_indices_device: Any) -> None:
        self.batch_size = len(keep_indices)

    def merge_batch(self, other: "SamplingBatchInfo") -> None:
        self.batch_size += other.batch_size


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The fields of SGLang's `ModelConfig` that `ScheduleBatch` reads on the memory paths
    (a text-only decoder; `vocab_size` only bounds output ids in `Req.check_finished`)."""

    vocab_size: int = 1 << 62
    hidden_size: int = 1
    is_matryoshka: bool = False
    is_encoder_decoder: bool = False


class NoSpeculation:
    """`SpeculativeAlgorithm.NONE` as `ScheduleBatch` asks it (the real enum lives in
    `speculative/spec_info.py`, which imports the EAGLE workers)."""

    def is_none(self) -> bool:
        return True

    def is_eagle(self) -> bool:
        return False


def _simple(**attrs: Any) -> Callable[[Path], dict]:
    return lambda root: dict(attrs)


def _placeholders(module: str, *names: str) -> Callable[[Path], dict]:
    return lambda root: {n: _placeholder(f"{module}.{n}") for n in names}


def _mixin(root: Path) -> dict:
    return {"ScheduleBatchDisaggregationDecodeMixin": type("ScheduleBatchDisaggregationDecodeMixin", (), {})}


class _VirtualMemory(NamedTuple):
    available: int


def _memory_pool_host(root: Path) -> dict:
    """SGLang's `HostKVCache` and `MHATokenToKVPoolHost`, borrowed from the real file: the real
    free list (`alloc` takes the head, `free` appends). Host memory is never pinned here, and
    `psutil` (the free-memory check) answers that there is room."""
    import importlib
    import threading
    from functools import wraps

    memory_pool = importlib.import_module("sglang.srt.mem_cache.memory_pool")
    psutil = types.SimpleNamespace(virtual_memory=lambda: _VirtualMemory(1 << 60))
    ns = borrow(root / "sglang/srt/mem_cache/memory_pool_host.py", ("synchronized", "HostKVCache", "MHATokenToKVPoolHost"),
                {"abc": __import__("abc"), "threading": threading, "wraps": wraps, "psutil": psutil,
                 "KVCache": memory_pool.KVCache, "MHATokenToKVPool": memory_pool.MHATokenToKVPool,
                 "MLATokenToKVPool": memory_pool.MLATokenToKVPool})
    real = ns["MHATokenToKVPoolHost"]

    class MHATokenToKVPoolHost(real):
        def __init__(self, device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory=False,
                     device="cpu"):
            super().__init__(device_pool, host_to_device_ratio, host_size, page_size, layout, False, device)

    return {"HostKVCache": ns["HostKVCache"], "MHATokenToKVPoolHost": MHATokenToKVPoolHost,
            "MLATokenToKVPoolHost": _placeholder("sglang.srt.mem_cache.memory_pool_host.MLATokenToKVPoolHost")}


class _DoneEvent:
    """A copy that finished the moment it was issued."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HiCacheAck(NamedTuple):
    start_event: Any
    finish_event: Any
    node_ids: list


class SyncHiCacheController:
    """A synchronous `HiCacheController`: the allocation and queueing of SGLang's controller
    (write: host slots from the host pool, one acknowledgement per write; load: device slots from
    the allocator, queued until `start_loading` merges them into one acknowledgement), with no
    data copied and every copy already finished. No storage backend."""

    def __init__(self, token_to_kv_pool_allocator, mem_pool_host, page_size, tp_group, load_cache_event=None,
                 write_policy="write_through_selective", io_backend="", storage_backend=None, prefetch_threshold=256,
                 model_name=None, storage_backend_extra_config=None):
        if storage_backend is not None:
            raise StandInUsed("the synchronous HiCacheController stand-in has no storage backend")
        if write_policy not in ("write_through", "write_through_selective", "write_back"):
            raise ValueError(f"Invalid write policy: {write_policy}")
        self.mem_pool_device_allocator = token_to_kv_pool_allocator
        self.mem_pool_host = mem_pool_host
        self.write_policy = write_policy
        self.page_size = page_size
        self.enable_storage = False
        self.reset()

    def reset(self) -> None:
        self.load_queue: list = []
        self.ack_write_queue: list = []
        self.ack_load_queue: list = []

    def write(self, device_indices, priority=None, node_id=-1):
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        self.ack_write_queue.append(HiCacheAck(_DoneEvent(), _DoneEvent(), [node_id]))
        return host_indices

    def load(self, host_indices, priority=None, node_id=-1):
        device_indices = self.mem_pool_device_allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.load_queue.append(node_id)
        return device_indices

    def start_loading(self) -> int:
        if not self.load_queue:
            return -1
        node_ids, self.load_queue = self.load_queue, []
        self.ack_load_queue.append(HiCacheAck(_DoneEvent(), _DoneEvent(), node_ids))
        return 0

    def evict_device(self, device_indices) -> int:
        self.mem_pool_device_allocator.free(device_indices)
        return len(device_indices)

    def evict_host(self, host_indices, backup_only: bool = True) -> int:
        self.mem_pool_host.free(host_indices)
        return len(host_indices)


STANDINS: dict[str, StandIn] = {
    "sglang": StandIn("the real package __init__ imports the whole frontend language API", _simple()),
    "sglang.srt.utils": StandIn("utils/common.py imports psutil, zmq, requests, ...; its pure helpers are "
                                "borrowed from the real file", _utils),
    "sglang.srt.utils.common": StandIn("same as sglang.srt.utils (schedule_batch imports is_npu from here)", _utils),
    "sglang.srt.utils.cuda_ipc_transport_utils": StandIn(
        "CUDA IPC for multimodal inputs", _placeholders("sglang.srt.utils.cuda_ipc_transport_utils",
                                                        "CudaIpcTensorTransportProxy")),
    "sglang.srt.server_args": StandIn("the real ServerArgs imports model configs, transformers and every "
                                      "backend; the memory paths read five fields", _server_args),
    "sglang.srt.disaggregation.kv_events": StandIn("the event publisher imports msgspec and zmq; the event "
                                                   "records are plain dataclasses", _kv_events),
    "sglang.srt.configs.mamba_utils": StandIn(
        "imports the distributed runtime; only used by Mamba pools",
        _placeholders("sglang.srt.configs.mamba_utils", "KimiLinearCacheParams", "Mamba2CacheParams")),
    "sglang.srt.layers.attention.nsa": StandIn("NSA attention kernels (sgl_kernel); only used by NSA pools",
                                               _simple(index_buf_accessor=None)),
    "sglang.srt.layers.attention.nsa.quant_k_cache": StandIn(
        "NSA FP8 quantisation kernels; only used by NSA pools",
        lambda root: {"quantize_k_cache": _unavailable("quantize_k_cache")}),
    "sglang.srt.layers.radix_attention": StandIn("model layer code; only used in type annotations",
                                                 _placeholders("sglang.srt.layers.radix_attention", "RadixAttention")),
    "sglang.srt.model_executor.forward_batch_info": StandIn(
        "imports the model runner and attention backends; ForwardMode and CaptureHiddenMode are borrowed "
        "from the real file", _forward_batch_info),
    "sglang.srt.constrained.base_grammar_backend": StandIn(
        "grammar backends (xgrammar, outlines); requests here have no grammar",
        _placeholders("sglang.srt.constrained.base_grammar_backend", "BaseGrammarObject")),
    "sglang.srt.disaggregation.base": StandIn("PD-disaggregation transfer engines",
                                              _placeholders("sglang.srt.disaggregation.base", "BaseKVSender")),
    "sglang.srt.disaggregation.decode_schedule_batch_mixin": StandIn(
        "PD-disaggregation decode side (imports transfer engines); an empty mixin", _mixin),
    "sglang.srt.distributed.parallel_state": StandIn("torch.distributed process groups; one rank here",
                                                     _simple(get_tensor_model_parallel_rank=lambda: 0)),
    "sglang.srt.metrics.collector": StandIn(
        "Prometheus metrics; requests keep their TimeStats fields",
        lambda root: {"TimeStats": TimeStats,
                      "SchedulerMetricsCollector": _placeholder("sglang.srt.metrics.collector.SchedulerMetricsCollector"),
                      "StorageMetricsCollector": _placeholder("sglang.srt.metrics.collector.StorageMetricsCollector")}),
    "sglang.srt.mem_cache.memory_pool_host": StandIn(
        "imports psutil and sgl_kernel's copy kernels; HostKVCache and MHATokenToKVPoolHost are borrowed from the"
        " real file (its free list), unpinned, with no data copied", _memory_pool_host),
    "sglang.srt.managers.cache_controller": StandIn(
        "HiCacheController runs CUDA streams, events and storage threads; a synchronous controller with the same"
        " allocation and acknowledgement queues, whose copies are done at once",
        _simple(HiCacheController=SyncHiCacheController, HiCacheAck=HiCacheAck,
                PrefetchOperation=_placeholder("sglang.srt.managers.cache_controller.PrefetchOperation"))),
    "sglang.srt.sampling.sampling_batch_info": StandIn("sampling tensors and penalizers; nothing is sampled here",
                                                       _simple(SamplingBatchInfo=SamplingBatchInfo)),
}
