"""Stand-ins for the vLLM 0.33.0 modules the KV-cache manager and the v1 scheduler import but
do not need on a CPU (pydantic configs, msgspec messages, zmq, CUDA probing, multimodal I/O).

A stand-in module holds, for each name vLLM imports from it, either a definition **borrowed**
from the wheel's own source file (the named top-level statements parsed out and executed,
never rewritten here) or a placeholder that raises `VllmStandInUsed` the moment vLLM calls or
instantiates it. A name not listed is an `ImportError`, so a new use shows at once.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import enum
import re
import sys
import types
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from memcli.errors import MemcliError


class VllmStandInUsed(MemcliError):
    """vLLM code reached a placeholder of a stand-in module: a feature memcli keeps off was used."""


def placeholder(name: str) -> type:
    """A class that may be named (annotations, isinstance) but never instantiated or called."""

    def refuse(*args, **kwargs):
        raise VllmStandInUsed(f"vLLM used {name}, which memcli replaces by a placeholder",
                              hint="the feature it belongs to is off in memcli's reference; add a stand-in")

    return type(name, (), {"__new__": refuse, "__init_subclass__": classmethod(lambda cls, **kw: None),
                           "__class_getitem__": classmethod(lambda cls, item: cls)})


def borrow(root: Path, relpath: str, names: tuple[str, ...], env: dict[str, Any]) -> dict[str, Any]:
    """Execute the top-level definitions `names` of the wheel's `relpath`, in source order,
    in a namespace that starts as `env`; return that namespace."""
    tree = ast.parse((root / relpath).read_text(encoding="utf-8"), filename=relpath)
    wanted, found = set(names), set()
    body = []
    for node in tree.body:
        defined = _defines(node)
        if defined & wanted:
            body.append(node)
            found |= defined & wanted
    missing = wanted - found
    if missing:
        raise VllmStandInUsed(f"{relpath} of the vLLM wheel no longer defines {', '.join(sorted(missing))}",
                              hint="update memcli.reference.vllm033.standins for this vLLM version")
    # A module of its own (dataclasses look a class's module up in sys.modules).
    module = types.ModuleType("memcli_borrowed_" + relpath.replace("/", "_")[:-3])
    module.__dict__.update(env)
    sys.modules[module.__name__] = module
    exec(compile(ast.Module(body, []), str(root / relpath), "exec"), module.__dict__)
    return module.__dict__


def _defines(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def _typing_env() -> dict[str, Any]:
    import typing
    from collections.abc import Callable as ABCCallable, Iterable, Mapping, Sequence
    return {"Any": Any, "Literal": typing.Literal, "Generic": typing.Generic, "TypeVar": typing.TypeVar,
            "Sequence": Sequence, "Iterable": Iterable, "Mapping": Mapping, "Callable": ABCCallable,
            "overload": typing.overload, "TYPE_CHECKING": False, "enum": enum, "time": __import__("time"),
            "dataclass": dataclasses.dataclass, "field": dataclasses.field}


# -- third-party stubs (installed only when the real package is absent) ----------------------

def _msgspec() -> types.ModuleType:
    """`msgspec.Struct` whose subclasses become dataclasses; encoders refuse."""
    module = types.ModuleType("msgspec")

    class Struct:
        def __init_subclass__(cls, **options):
            super().__init_subclass__()
            annotations = {}
            for klass in reversed(cls.__mro__):
                annotations.update(klass.__dict__.get("__annotations__", {}))
            for name, value in list(cls.__dict__.items()):
                if name in annotations and isinstance(value, (list, dict, set)):
                    setattr(cls, name, dataclasses.field(default_factory=lambda v=value: type(v)(v)))
            dataclasses.dataclass(cls, eq=True, repr=True, unsafe_hash=False)

    def refuse(*args, **kwargs):
        raise VllmStandInUsed("vLLM tried to serialize with msgspec, which memcli stubs out")

    module.Struct, module.field = Struct, dataclasses.field
    module.msgpack = types.SimpleNamespace(Encoder=refuse, Decoder=refuse, encode=refuse, decode=refuse)
    module.json = types.SimpleNamespace(Encoder=refuse, Decoder=refuse, encode=refuse, decode=refuse)
    module.UNSET, module.Meta = object(), placeholder("Meta")
    return module


def _cbor2() -> types.ModuleType:
    module = types.ModuleType("cbor2")

    def dumps(*args, **kwargs):
        raise VllmStandInUsed("a cbor hash function was asked for; memcli's reference uses vLLM's default sha256")

    module.dumps = dumps
    return module


def _regex() -> types.ModuleType:
    module = types.ModuleType("regex")
    module.__dict__.update({k: getattr(re, k) for k in dir(re) if not k.startswith("__")})
    return module


THIRD_PARTY: dict[str, Callable[[], types.ModuleType]] = {"msgspec": _msgspec, "cbor2": _cbor2, "regex": _regex}


def install_third_party() -> list[str]:
    """Put the stubs of absent third-party packages into `sys.modules`; return their names."""
    import importlib.util
    installed = []
    for name, build in THIRD_PARTY.items():
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = build()
            installed.append(name)
    return installed


# -- the vLLM stand-ins --------------------------------------------------------------------

class StandIn(NamedTuple):
    reason: str
    build: Callable[[Path], dict[str, Any]]


def _placeholders(*names: str, **values: Any) -> Callable[[Path], dict[str, Any]]:
    return lambda root: {**{n: placeholder(n) for n in names}, **values}


def _config(root: Path) -> dict[str, Any]:
    names = ("VllmConfig", "KVEventsConfig", "CacheConfig", "ModelConfig", "SchedulerConfig", "SpeculativeConfig",
             "StructuredOutputsConfig", "ParallelConfig", "LoRAConfig")
    return {**{n: placeholder(n) for n in names}, "get_current_vllm_config_or_none": lambda: None,
            "get_current_vllm_config": lambda: None}


def _kv_events(root: Path) -> dict[str, Any]:
    import msgspec  # the stub when the package is absent
    env = {**_typing_env(), "msgspec": msgspec, "ExternalBlockHash": Any}
    ns = borrow(root, "vllm/distributed/kv_events.py",
                ("EventBatch", "KVCacheEvent", "MEDIUM_GPU", "MEDIUM_CPU", "MEDIUM_STORAGE", "BlockStored",
                 "BlockRemoved", "AllBlocksCleared", "KVEventBatch"), env)

    class NullPublisher:
        def publish(self, events) -> None:
            return None

        def shutdown(self) -> None:
            return None

    factory = types.SimpleNamespace(create=lambda *a, **k: NullPublisher())
    keep = ("EventBatch", "KVCacheEvent", "MEDIUM_GPU", "MEDIUM_CPU", "MEDIUM_STORAGE", "BlockStored",
            "BlockRemoved", "AllBlocksCleared", "KVEventBatch")
    return {**{k: ns[k] for k in keep}, "EventPublisherFactory": factory,
            "KVConnectorKVEvents": placeholder("KVConnectorKVEvents"), "KVEventAggregator": placeholder("KVEventAggregator")}


@dataclasses.dataclass
class SamplingParams:
    """The fields of vLLM's `SamplingParams` that `Request` and the scheduler read, with the
    values the real `__post_init__` leaves for a plain request (no logprobs, so
    `skip_reading_prefix_cache` is False)."""

    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop_token_ids: Optional[list] = None
    eos_token_id: Optional[int] = None
    ignore_eos: bool = True
    extra_args: Optional[dict] = None
    structured_outputs: Any = None
    skip_reading_prefix_cache: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    n: int = 1
    output_kind: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Optional[int] = None

    @property
    def num_logprobs(self) -> Optional[int]:
        return self.logprobs

    @property
    def all_stop_token_ids(self) -> set:
        return set(self.stop_token_ids or ())

    def clone(self) -> "SamplingParams":
        return dataclasses.replace(self)


def _sampling_params(root: Path) -> dict[str, Any]:
    return {"SamplingParams": SamplingParams, "RepetitionDetectionParams": placeholder("RepetitionDetectionParams"),
            "RequestOutputKind": placeholder("RequestOutputKind"), "SamplingType": placeholder("SamplingType")}


def _engine(root: Path) -> dict[str, Any]:
    import msgspec
    import numpy as np
    import torch
    names = ("FINISH_REASON_STRINGS", "FinishReason", "EngineCoreRequest", "EngineCoreEventType", "EngineCoreEvent", "EngineCoreOutput",
             "UtilityOutput", "EngineCoreOutputs")
    env = {**_typing_env(), "msgspec": msgspec, "np": np, "torch": torch,
           **{n: Any for n in ("LoRARequest", "MultiModalFeatureSpec", "RequestError", "PoolingParams",
                               "SamplingParams", "KvHintsEnvelope", "SchedulerStats", "LogprobsLists",
                               "LogprobsTensors", "SamplingMaskLists", "UtilityResult", "KVEventsConfig",
                               "PrefillStats", "RequestSpecDecodeMetrics")}}
    ns = borrow(root, "vllm/v1/engine/__init__.py", names, env)
    return {n: ns[n] for n in names}


def _v1_utils(root: Path) -> dict[str, Any]:
    import torch
    from typing import Generic, TypeVar, overload
    from collections.abc import Sequence
    ns = borrow(root, "vllm/v1/utils.py", ("T", "ConstantList", "tensor_data"),
                {"Generic": Generic, "TypeVar": TypeVar, "overload": overload, "Sequence": Sequence, "torch": torch})
    return {"ConstantList": ns["ConstantList"], "tensor_data": ns["tensor_data"],
            "record_function_or_nullcontext": lambda name: contextlib.nullcontext()}


def _torch_utils(root: Path) -> dict[str, Any]:
    import torch
    size = lambda dtype: torch.tensor([], dtype=dtype).element_size()  # noqa: E731
    return {"get_dtype_size": size, "PIN_MEMORY": False}


def _multimodal_utils(root: Path) -> dict[str, Any]:
    ns = borrow(root, "vllm/multimodal/utils.py", ("get_mm_features_in_window", "strip_covered_mm_data"),
                {**_typing_env(), "MultiModalFeatureSpec": Any})
    return {"get_mm_features_in_window": ns["get_mm_features_in_window"],
            "strip_covered_mm_data": ns["strip_covered_mm_data"]}


def _platforms(root: Path) -> dict[str, Any]:
    platform = types.SimpleNamespace(register_custom_kv_cache_specs=lambda *a, **k: None, device_type="cpu",
                                     is_cuda=lambda: False, is_rocm=lambda: False, is_cpu=lambda: True, is_xpu=lambda: False)
    return {"current_platform": platform}


def _structured_request(root: Path) -> dict[str, Any]:
    class StructuredOutputRequest:
        """No request of memcli's has a grammar: `from_sampling_params` gives None, or refuses."""

        @staticmethod
        def from_sampling_params(sampling_params: Any) -> None:
            if sampling_params is not None and sampling_params.structured_outputs:
                raise VllmStandInUsed("a request with structured outputs reached memcli's vLLM reference")
            return None

    return {"StructuredOutputRequest": StructuredOutputRequest}


STANDINS: dict[str, StandIn] = {
    "vllm.config": StandIn("pydantic configs that pull in transformers", _config),
    "vllm.config.ec_manager_config": StandIn("encoder-cache connector config (off)",
                                             _placeholders("EncoderCacheManagerMetadata")),
    "vllm.distributed.kv_events": StandIn("msgspec Structs and a zmq publisher: Structs borrowed, publisher no-op",
                                          _kv_events),
    "vllm.sampling_params": StandIn("msgspec/pydantic and tokenizers: the fields Request reads", _sampling_params),
    "vllm.v1.engine": StandIn("msgspec engine messages, borrowed", _engine),
    "vllm.v1.utils": StandIn("process and zmq utilities: ConstantList borrowed", _v1_utils),
    "vllm.utils.torch_utils": StandIn("custom-op registration and CUDA", _torch_utils),
    "vllm.multimodal": StandIn("PIL and media I/O", _placeholders("MultiModalRegistry", MULTIMODAL_REGISTRY=None)),
    "vllm.multimodal.inputs": StandIn("PIL and media I/O", _placeholders("MultiModalFeatureSpec", "MultiModalKwargsItem")),
    "vllm.multimodal.utils": StandIn("PIL and media I/O: two window helpers borrowed", _multimodal_utils),
    "vllm.multimodal.encoder_budget": StandIn("multimodal (off)", _placeholders("MultiModalBudget")),
    "vllm.pooling_params": StandIn("pooling models (off)", _placeholders("PoolingParams")),
    "vllm.v1.kv_hints": StandIn("KV hints (off)", _placeholders("KvHintsEnvelope")),
    "vllm.v1.structured_output": StandIn("grammars (off)", _placeholders("StructuredOutputManager")),
    "vllm.v1.structured_output.request": StandIn("grammars (off): no request has one", _structured_request),
    "vllm.v1.structured_output.utils": StandIn("grammars (off)", _placeholders("strip_speculative_padding")),
    "vllm.compilation.cuda_graph": StandIn("CUDA graphs", _placeholders("CUDAGraphStat")),
    "vllm.v1.metrics.perf": StandIn("performance metrics (off)", _placeholders("PerfStats", "ModelMetrics")),
    "vllm.v1.spec_decode.metrics": StandIn("speculative decoding (off)", _placeholders("SpecDecodingStats")),
    "vllm.v1.spec_decode.dynamic.utils": StandIn("speculative decoding (off)",
                                                 _placeholders("build_dynamic_sd_schedule_lookup")),
    "vllm.platforms": StandIn("CUDA / ROCm / TPU probing: a CPU platform", _platforms),
    "vllm.outputs": StandIn("request outputs (tokenizers)", _placeholders("RequestError")),
    "vllm.distributed.aux_output_connector.connector": StandIn(
        "connectors (off)", _placeholders("AuxOutputSchedulerConnector", "AuxRequestOutput")),
    "vllm.distributed.ec_transfer.ec_connector.base": StandIn(
        "connectors (off)", _placeholders("ECConnectorMetadata", "ECConnectorRole", "ECConnectorBase")),
    "vllm.distributed.ec_transfer.ec_connector.factory": StandIn("connectors (off)", _placeholders("ECConnectorFactory")),
    "vllm.distributed.ec_transfer.ec_connector.metrics": StandIn("connectors (off)", _placeholders("ECConnectorStats")),
    "vllm.distributed.kv_transfer.kv_connector.factory": StandIn("connectors (off)", _placeholders("KVConnectorFactory")),
    "vllm.distributed.kv_transfer.kv_connector.v1": StandIn(
        "connectors (off)", _placeholders("KVConnectorBase_V1", "KVConnectorRole", "SupportsHMA", "supports_hma")),
    "vllm.distributed.kv_transfer.kv_connector.v1.base": StandIn("connectors (off)", _placeholders("KVConnectorMetadata")),
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics": StandIn("connectors (off)", _placeholders("KVConnectorStats")),
}

# Packages whose `__init__` would pull in engines, NCCL groups, torch.compile or loggers:
# their submodules load, their `__init__` does not run.
SKIPPED_INITS = ("vllm", "vllm.distributed", "vllm.compilation", "vllm.v1.metrics", "vllm.v1.spec_decode",
                 "vllm.v1.hisparse", "vllm.v1.attention", "vllm.v1.attention.backends")
