"""Import SGLang 0.5.23's real memory-stack modules from its unpacked wheel, on CPU.

    ref = load_reference_0523()          # once per process
    ref.UnifiedRadixCache, ref.Req, ref.ScheduleBatch, ref.PrefillAdder, ref.allocation, ...

The tree core is chosen per tree (`CacheInitParams.tree_core_backend`: "rust", SGLang's
default, or "python", its readable twin); `memcli.reference.v0523.stack` builds both.
`sglang` cannot be imported twice in one process, so this reference never shares a process
with the 0.5.5 one: memcli drives it through `memcli.reference.v0523.worker`.

Unlike 0.5.5 (a small extracted subset with many stand-ins), 0.5.23 is imported from its
whole `sglang/srt` and `sglang/kernels` trees under their real names, through one finder
first on `sys.meta_path`:

* `sglang.*` comes from the unpacked wheel (the compiled Rust tree core included), never from
  an installed sglang;
* the packages of `SKIPPED_INITS` are packages without their `__init__` (their submodules
  still load);
* the modules of `standins_0523.STANDINS` are replaced (each raises `StandInUsed` if called);
* a third-party package of `AUTO_STUBS` that is not installed gets a placeholder module
  (attribute access gives placeholder classes; calling one raises `StandInUsed`).

`msgspec` is a test dependency (memcli's `[test]` extra), used for real. No Triton kernel is
launched: SGLang's CPU platform reports no Triton and takes its torch paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from memcli.errors import MemcliError
from memcli.reference.fetch import SGLANG_0523, fetch_reference
from memcli.reference.standins import StandInUsed
from memcli.reference.v0523.standins import STANDINS

SKIPPED_INITS = ("sglang", "sglang.srt.configs", "sglang.srt.layers.quantization")
AUTO_STUBS = ("PIL", "orjson", "psutil", "pybase64", "requests", "starlette", "zmq", "tvm_ffi", "tqdm",
              "dill", "sgl_kernel")
MODULES = {
    "allocator": "sglang.srt.mem_cache.allocator",
    "memory_pool": "sglang.srt.mem_cache.memory_pool",
    "base_prefix_cache": "sglang.srt.mem_cache.base_prefix_cache",
    "radix_cache": "sglang.srt.mem_cache.radix_cache",
    "unified_radix_cache": "sglang.srt.mem_cache.unified_radix_cache",
    "cache_init_params": "sglang.srt.mem_cache.cache_init_params",
    "common": "sglang.srt.mem_cache.common",
    "allocation": "sglang.srt.mem_cache.allocation",
    "prefill_budget": "sglang.srt.mem_cache.prefill_budget",
    "schedule_batch": "sglang.srt.managers.schedule_batch",
    "schedule_policy": "sglang.srt.managers.schedule_policy",
    "server_args": "sglang.srt.server_args",
    "runtime_context": "sglang.srt.runtime_context",
}
_LOOKUP_ORDER = ("unified_radix_cache", "base_prefix_cache", "cache_init_params", "allocator", "memory_pool",
                 "schedule_batch", "schedule_policy", "radix_cache", "common", "allocation", "prefill_budget",
                 "server_args", "runtime_context")


class ReferenceImportError(MemcliError):
    """SGLang 0.5.23's modules could not be imported from the unpacked wheel."""


class _Placeholder(type):
    """Classes of an auto-stubbed package: usable as bases, in annotations and `except`."""

    def __call__(cls, *args, **kwargs):
        raise StandInUsed(f"{cls.__module__}.{cls.__name__} is an auto-stub of the memcli reference loader")

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder_class(f"{cls.__module__}.{cls.__name__}", name)


def _placeholder_class(module: str, name: str) -> type:
    return _Placeholder(name, (Exception,), {"__module__": module})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder_class(self.__name__, name)
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    """Builds stand-ins, auto-stubs and `__init__`-less packages."""

    def __init__(self, root: Path):
        self.root = root
        self.standins_built: list[str] = []

    def create_module(self, spec):
        return _StubModule(spec.name) if spec.loader_state == "stub" or spec.name in STANDINS else None

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        if name in STANDINS:
            module.__dict__.update(STANDINS[name].build(self.root))
            module.__memcli_standin__ = STANDINS[name].reason
            self.standins_built.append(name)
        elif module.__spec__.loader_state == "stub":
            module.__memcli_standin__ = "auto-stub"


class Finder0523(importlib.abc.MetaPathFinder):
    """Resolves `sglang.*` from `root` (stand-ins and skipped `__init__`s applied) and the
    missing `AUTO_STUBS` packages; nothing else."""

    def __init__(self, root: Path):
        self.root = root
        self.loader = _Loader(root)
        self.missing = {name for name in AUTO_STUBS if not _installed(name)}

    def find_spec(self, fullname: str, path=None, target=None):
        top = fullname.split(".", 1)[0]
        if top in self.missing:
            spec = importlib.machinery.ModuleSpec(fullname, self.loader, is_package=True, loader_state="stub")
            spec.submodule_search_locations = []
            return spec
        if top != "sglang":
            return None
        rel = self.root.joinpath(*fullname.split("."))
        if fullname in STANDINS:
            return importlib.machinery.ModuleSpec(fullname, self.loader, is_package=False)
        if fullname in SKIPPED_INITS:
            spec = importlib.machinery.ModuleSpec(fullname, self.loader, is_package=True)
            spec.submodule_search_locations = [str(rel)]
            return spec
        search = [str(rel.parent)]
        spec = importlib.machinery.PathFinder.find_spec(fullname, search)
        if spec is None:
            raise ModuleNotFoundError(f"{fullname} is not in the sglang {SGLANG_0523} wheel", name=fullname)
        return spec


def _installed(name: str) -> bool:
    return importlib.machinery.PathFinder.find_spec(name) is not None


@dataclass
class Reference0523:
    """SGLang 0.5.23's real classes and modules, the tree core in force and the stand-ins used."""

    root: Path
    modules: dict[str, types.ModuleType]
    standins: dict[str, str]
    stubbed: tuple[str, ...]

    def __getattr__(self, name: str) -> Any:
        modules = self.__dict__.get("modules", {})
        if name in modules:
            return modules[name]
        for key in _LOOKUP_ORDER:
            module = modules.get(key)
            if module is not None and hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"the SGLang {SGLANG_0523} reference has no {name!r}")


_loaded: Optional[Reference0523] = None


def _check_no_other_sglang() -> None:
    existing = sys.modules.get("sglang")
    if existing is not None and not str(getattr(existing, "__path__", [""])[0]).endswith(f"sglang-{SGLANG_0523}/sglang"):
        raise ReferenceImportError(
            "another sglang is already imported in this process (the 0.5.5 reference or an installed one)",
            hint="run the 0.5.23 reference in its own process (pytest runs tests/reference_0523 separately)")


def load_reference_0523(cache_dir: Optional[Path] = None) -> Reference0523:
    """Fetch the wheel if needed and import 0.5.23's memory-stack modules (once per process).

    Raises `ReferenceFetchError` or `ReferenceImportError`.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    root = fetch_reference(cache_dir, SGLANG_0523)
    _check_no_other_sglang()
    finder = Finder0523(root)
    sys.meta_path.insert(0, finder)
    modules = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for key, name in MODULES.items():
                modules[key] = importlib.import_module(name)
    except ImportError as exc:
        raise ReferenceImportError(f"cannot import SGLang {SGLANG_0523} from {root}: {exc}",
                                   hint="delete the unpacked directory to unpack it again") from exc
    logging.getLogger("sglang").setLevel(logging.ERROR)
    standins = {name: STANDINS[name].reason for name in finder.loader.standins_built}
    _loaded = Reference0523(root, modules, standins, tuple(sorted(finder.missing)))
    return _loaded
