"""Import SGLang 0.5.5's real memory-stack modules from the extracted wheel.

    ref = load_reference()
    alloc = ref.PagedTokenToKVPoolAllocator(64, 16, torch.int64, ref.device, ref.tiny_kv_pool(64, 16), False)
    tree = ref.RadixCache(None, alloc, 16)
    ref.use_clock(LogicalClock())

The modules are imported under their real names (`sglang.srt.mem_cache.radix_cache`, ...)
through one import hook placed first on `sys.meta_path`. The hook answers every `sglang.*`
import, so an installed sglang of another version is never mixed in:

* a module whose file was extracted (see `fetch.EXTRACT`) is imported from that file;
* a module listed in `standins.STANDINS` is built from its stand-in (recorded in
  `Reference.standins`);
* a directory without `__init__.py` is a namespace package;
* anything else raises ModuleNotFoundError, naming the module, so a new dependency shows.

Triton kernels: SGLang decorates them at import time, and Triton chooses between compiling
and interpreting at that moment. Without CUDA the loader sets `TRITON_INTERPRET=1` (for the
rest of the process: Triton's interpreter reads it again later), so the allocator kernels (`alloc_extend_kernel`, `alloc_decode_kernel`) run in
the interpreter on CPU tensors.

Attention backend: `mem_cache.common` reads the server argument `attention_backend` on every
call. The loader sets the one SGLang picks by default on the device the reference runs on
(`backends.default_backend`: fa3 on an H100 or H200, torch_native on a CPU), so that a GPU
run takes SGLang's Triton write paths as a server there does; `use_attention_backend`
picks another.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from memcli.errors import MemcliError
from memcli.reference.backends import default_backend
from memcli.reference.fetch import SGLANG_VERSION, fetch_reference
from memcli.reference.standins import STANDINS

MODULES = {
    "allocator": "sglang.srt.mem_cache.allocator",
    "memory_pool": "sglang.srt.mem_cache.memory_pool",
    "radix_cache": "sglang.srt.mem_cache.radix_cache",
    "chunk_cache": "sglang.srt.mem_cache.chunk_cache",
    "evict_policy": "sglang.srt.mem_cache.evict_policy",
    "common": "sglang.srt.mem_cache.common",
    "schedule_batch": "sglang.srt.managers.schedule_batch",
    "schedule_policy": "sglang.srt.managers.schedule_policy",
    "hiradix_cache": "sglang.srt.mem_cache.hiradix_cache",
}
# Modules whose `time.monotonic()` stamps tree nodes (`use_clock` replaces their `time`).
CLOCKED = ("radix_cache", "hiradix_cache")


class ReferenceImportError(MemcliError):
    """SGLang's modules could not be imported from the extracted wheel."""


class StandInLoader(importlib.abc.Loader):
    """Builds the modules of `standins` (name -> `StandIn`: its `build(root)` and `reason`),
    recording each built name in `built`; any other module it is given (a package without an
    `__init__`) stays empty. Used by the finders of every engine's wheel."""

    def __init__(self, root: Path, built: list[str], standins: dict = STANDINS):
        self.root, self.built, self.standins = root, built, standins

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        stand_in = self.standins.get(name)
        if stand_in is not None:
            module.__dict__.update(stand_in.build(self.root))
            module.__memcli_standin__ = stand_in.reason
            self.built.append(name)


class SglangFinder(importlib.abc.MetaPathFinder):
    """Resolves `sglang` and `sglang.*` from `root` and the stand-ins, and nothing else."""

    def __init__(self, root: Path):
        self.root = root
        self.standins_built: list[str] = []
        self._standin_loader = StandInLoader(root, self.standins_built)
        # Parent packages of the stand-ins that have no directory in the extracted tree.
        self._parents = {name.rsplit(".", i)[0] for name in STANDINS for i in range(1, name.count(".") + 1)}

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        rel = self.root.joinpath(*fullname.split("."))
        if fullname in STANDINS:
            return importlib.machinery.ModuleSpec(fullname, self._standin_loader, is_package=True)
        if rel.with_suffix(".py").is_file():
            return importlib.util.spec_from_file_location(fullname, rel.with_suffix(".py"))
        if rel.is_dir() or fullname in self._parents:
            spec = importlib.machinery.ModuleSpec(fullname, self._standin_loader, is_package=True)
            spec.submodule_search_locations = [str(rel)] if rel.is_dir() else []
            return spec
        raise ModuleNotFoundError(
            f"{fullname} is neither extracted from the sglang {SGLANG_VERSION} wheel nor a stand-in"
            " (add it to memcli.reference.fetch.EXTRACT or memcli.reference.standins.STANDINS)",
            name=fullname)


@dataclass
class Reference:
    """SGLang's real classes and modules, plus what the loader replaced."""

    root: Path
    modules: dict[str, types.ModuleType]
    standins: dict[str, str]  # module name -> why it is a stand-in (only those imported)
    interpreted: bool  # True when the Triton kernels run in the interpreter
    _clock_saved: list = field(default_factory=list, repr=False)

    def __getattr__(self, name: str) -> Any:
        modules = self.__dict__.get("modules", {})
        if name in modules:
            return modules[name]
        for module_key in ("radix_cache", "allocator", "memory_pool", "chunk_cache",
                           "schedule_batch", "schedule_policy"):
            module = modules.get(module_key)
            if module is not None and hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"the SGLang reference has no {name!r}")

    def use_clock(self, clock: Any) -> None:
        """Make RadixCache/TreeNode read `clock()` where they read `time.monotonic()`.

        Module-wide: every RadixCache of this process sees it. `clock` is a zero-argument
        callable (e.g. `memcli.mem_cache.clock.LogicalClock()`). `restore_clock` undoes it.
        """
        fake = types.SimpleNamespace(monotonic=clock, time=clock, perf_counter=clock)
        self._clock_saved.append([self.modules[name].time for name in CLOCKED])
        for name in CLOCKED:
            self.modules[name].time = fake

    @property
    def device(self) -> str:
        """Where SGLang's pools live: the CPU under the interpreter, else the GPU its compiled
        kernels run on (they take no CPU tensors)."""
        return "cpu" if self.interpreted else "cuda"

    @property
    def attention_backend(self) -> str:
        """The `attention_backend` server argument SGLang's memory path reads now."""
        return sys.modules["sglang.srt.server_args"].get_global_server_args().attention_backend

    def use_attention_backend(self, name: str) -> None:
        """Make SGLang's memory path read `attention_backend = name` (process-wide: every
        caller of this reference sees it)."""
        server_args = sys.modules["sglang.srt.server_args"]
        server_args.set_global_server_args_for_scheduler(server_args.ServerArgs(attention_backend=name))

    def restore_clock(self) -> None:
        if self._clock_saved:
            for name, saved in zip(CLOCKED, self._clock_saved.pop()):
                self.modules[name].time = saved

    def tiny_kv_pool(self, size: int, page_size: int, layer_num: int = 1, head_num: int = 1,
                     head_dim: int = 1, dtype: torch.dtype = torch.float32) -> Any:
        """A real `MHATokenToKVPool` with one layer of one 1-wide head, on `device`: the
        allocators only keep a reference to it."""
        return self.MHATokenToKVPool(size, page_size, dtype, head_num, head_dim, layer_num, self.device,
                                     enable_memory_saver=False, enable_alt_stream=False)


_loaded: Optional[Reference] = None


class _SingleRankTorch(types.ModuleType):
    """torch, except that `torch.distributed` is one rank with no process group: HiRadixCache
    asks the world size of its tensor-parallel group (and synchronises only when it is > 1)."""

    def __init__(self):
        super().__init__("torch")
        self.distributed = types.SimpleNamespace(get_world_size=lambda group=None: 1,
                                                 ProcessGroup=torch.distributed.ProcessGroup)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _single_rank(module: types.ModuleType) -> None:
    module.torch = _SingleRankTorch()


def choose_triton_mode(interpret: Optional[bool] = None) -> bool:
    """Set `TRITON_INTERPRET=1` for the whole process when asked (None: when CUDA is
    unavailable). Triton reads it both when a kernel is decorated and, lazily, inside its
    interpreter, so it cannot be undone, and it binds only kernels decorated after it:
    SGLang's (imported by `load_reference`, which calls this first) and memcli's own
    (`memcli.kernels`, imported with `memcli.stack`), so a process that runs both calls it
    before importing either. Returns whether kernels decorated from now on are interpreted."""
    if interpret is None:
        interpret = not torch.cuda.is_available()
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check_no_foreign_sglang(root: Path) -> None:
    existing = sys.modules.get("sglang")
    if existing is not None and not getattr(existing, "__memcli_standin__", None):
        raise ReferenceImportError(
            f"another sglang is already imported ({getattr(existing, '__file__', existing)})",
            hint="load the reference in a process that does not import sglang itself")


def load_reference(cache_dir: Optional[Path] = None, interpret: Optional[bool] = None) -> Reference:
    """Fetch the wheel if needed and import SGLang's memory-stack modules (once per process).

    `interpret`: run Triton kernels in the interpreter; default: when CUDA is unavailable.
    Raises `ReferenceFetchError` (download) or `ReferenceImportError` (import).
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    root = fetch_reference(cache_dir)
    _check_no_foreign_sglang(root)
    interpreted = choose_triton_mode(interpret)
    finder = SglangFinder(root)
    sys.meta_path.insert(0, finder)
    modules = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # sampling_params imports sre_parse
            for key, name in MODULES.items():
                modules[key] = importlib.import_module(name)
    except ImportError as exc:
        raise ReferenceImportError(f"cannot import SGLang {SGLANG_VERSION} from {root}: {exc}",
                                   hint="delete the extracted directory to unpack it again") from exc
    _single_rank(modules["hiradix_cache"])
    standins = {name: STANDINS[name].reason for name in finder.standins_built}
    _loaded = Reference(root, modules, standins, interpreted)
    _loaded.use_attention_backend(default_backend(torch.device(_loaded.device).type))
    return _loaded
