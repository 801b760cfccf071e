"""Import vLLM 0.33.0's real KV-cache manager and v1 scheduler from the extracted wheel.

    ref = load_vllm()
    manager = ref.kv_cache_manager.KVCacheManager(...)

One import hook, first on `sys.meta_path`, answers every `vllm` / `vllm.*` import:

* a stand-in of `standins.STANDINS` (recorded in `VllmReference.standins`);
* a package of `standins.SKIPPED_INITS`: its submodules load, its `__init__` does not run;
* a module whose file was extracted (`fetch.VLLM_EXTRACT`) is imported from that file;
* a directory without `__init__.py` is a namespace package;
* anything else raises ModuleNotFoundError naming the module, so a new dependency shows.

Third-party packages vLLM imports on this path (`msgspec`, `cbor2`, `regex`) are stubbed only
when they are not installed. Nothing needs CUDA, `vllm._C` or Triton.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from memcli.errors import MemcliError
from memcli.reference.fetch import VLLM, fetch_reference, unavailable_reason
from memcli.reference.loader import StandInLoader
from memcli.reference.vllm033.standins import SKIPPED_INITS, STANDINS, install_third_party

MODULES = {
    "kv_cache_utils": "vllm.v1.core.kv_cache_utils",
    "block_pool": "vllm.v1.core.block_pool",
    "kv_cache_manager": "vllm.v1.core.kv_cache_manager",
    "kv_cache_interface": "vllm.v1.kv_cache_interface",
    "request": "vllm.v1.request",
    "hashing": "vllm.utils.hashing",
    "stats": "vllm.v1.metrics.stats",
    "kv_events": "vllm.distributed.kv_events",
}
SCHEDULER_MODULES = {
    "scheduler": "vllm.v1.core.sched.scheduler",
    "async_scheduler": "vllm.v1.core.sched.async_scheduler",
    "outputs": "vllm.v1.outputs",
}


class VllmImportError(MemcliError):
    """vLLM's modules could not be imported from the extracted wheel."""


class VllmFinder(importlib.abc.MetaPathFinder):
    """Resolves `vllm` and `vllm.*` from `root`, the stand-ins and the skipped packages only."""

    def __init__(self, root: Path):
        self.root = root
        self.standins_built: list[str] = []
        self._loader = StandInLoader(root, self.standins_built, STANDINS)
        self._parents = {name.rsplit(".", i)[0] for name in STANDINS for i in range(1, name.count(".") + 1)}

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        rel = self.root.joinpath(*fullname.split("."))
        if fullname in STANDINS:
            return importlib.machinery.ModuleSpec(fullname, self._loader, is_package=True)
        if fullname in SKIPPED_INITS or (rel.is_dir() and not (rel / "__init__.py").is_file()) \
                or (fullname in self._parents and not rel.with_suffix(".py").is_file() and not rel.is_dir()):
            spec = importlib.machinery.ModuleSpec(fullname, self._loader, is_package=True)
            spec.submodule_search_locations = [str(rel)] if rel.is_dir() else []
            return spec
        if rel.with_suffix(".py").is_file():
            return importlib.util.spec_from_file_location(fullname, rel.with_suffix(".py"))
        if (rel / "__init__.py").is_file():
            return importlib.util.spec_from_file_location(fullname, rel / "__init__.py",
                                                          submodule_search_locations=[str(rel)])
        raise ModuleNotFoundError(
            f"{fullname} is neither extracted from the vllm {VLLM.version} wheel nor a stand-in"
            " (add it to memcli.reference.fetch.VLLM_EXTRACT or memcli.reference.vllm033.standins.STANDINS)",
            name=fullname)


@dataclass
class VllmReference:
    """vLLM's real modules (by short name) and what the loader replaced."""

    root: Path
    modules: dict[str, types.ModuleType]
    standins: dict[str, str]  # module name -> why it is a stand-in (only those imported)
    third_party_stubs: list[str]

    def __getattr__(self, name: str) -> Any:
        modules = self.__dict__.get("modules", {})
        if name in modules:
            return modules[name]
        raise AttributeError(f"the vLLM reference has no {name!r}")


_loaded: dict[str, VllmReference] = {}
_finder: list[VllmFinder] = []


def _check_no_foreign_vllm() -> None:
    existing = sys.modules.get("vllm")
    if existing is not None and not _finder:
        raise VllmImportError(f"another vllm is already imported ({getattr(existing, '__file__', existing)})",
                              hint="load the reference in a process that does not import vllm itself")


def _import(keys: dict[str, str], root: Path) -> dict[str, types.ModuleType]:
    try:
        return {key: importlib.import_module(name) for key, name in keys.items()}
    except ImportError as exc:
        raise VllmImportError(f"cannot import vLLM {VLLM.version} from {root}: {exc}",
                              hint="delete the extracted directory to unpack it again") from exc


def load_vllm(cache_dir: Optional[Path] = None, scheduler: bool = False) -> VllmReference:
    """Fetch the wheel if needed and import vLLM's KV-cache manager (and, with `scheduler`,
    the v1 scheduler) once per process. Raises `ReferenceFetchError` or `VllmImportError`."""
    key = "scheduler" if scheduler else "manager"
    if key in _loaded:
        return _loaded[key]
    root = fetch_reference(cache_dir, VLLM)
    _check_no_foreign_vllm()
    stubs = install_third_party()
    if not _finder:
        _finder.append(VllmFinder(root))
        sys.meta_path.insert(0, _finder[0])
    finder = _finder[0]
    modules = _import(MODULES, root)
    if scheduler:
        modules.update(_import(SCHEDULER_MODULES, root))
    modules["kv_cache_utils"].init_none_hash(modules["hashing"].sha256)
    standins = {name: STANDINS[name].reason for name in finder.standins_built}
    _loaded[key] = VllmReference(root, modules, standins, stubs)
    return _loaded[key]


def vllm_unavailable_reason(cache_dir: Optional[Path] = None) -> Optional[str]:
    """None when vLLM's wheel is ready; the reason when the package index cannot be reached."""
    return unavailable_reason(cache_dir, VLLM)
