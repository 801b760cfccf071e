"""Obtain an engine's wheel from PyPI and unpack the few files its reference needs.

A `Wheel` names the package, its pinned version and the files to extract: `SGLANG` (SGLang
0.5.5, the default of every function here), `SGLANG_0523_WHEEL` (SGLang 0.5.23) and `VLLM`
(vLLM 0.33.0). Every function takes `wheel`: a `Wheel`, or an SGLang version string
(`SGLANG_VERSION`, `SGLANG_0523`). Layout of the cache (never inside the repository):

    <cache_dir>/reference/sglang-0.5.5-py3-none-any.whl    the wheel, as pip downloaded it
    <cache_dir>/reference/sglang-0.5.5/sglang/srt/...       the extracted subset (`Wheel.extract`)
    <cache_dir>/reference/sglang-0.5.23-cp311-...whl       0.5.23 (cp311 only: compiled Rust parts)
    <cache_dir>/reference/sglang-0.5.23/sglang/...
    <cache_dir>/reference/vllm-0.33.0-cp38-abi3-...whl      the same for vLLM
    <cache_dir>/reference/vllm-0.33.0/vllm/...

`cache_dir` is `$MEMCLI_CACHE_DIR`, else `~/.cache/memcli`. The wheel is downloaded once
(`python -m pip download --no-deps`) and reused; extraction is redone only when its marker
file is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional, Union

from memcli.errors import MemcliError

SGLANG_VERSION = "0.5.5"
SGLANG_0523 = "0.5.23"
REQUIREMENT = f"sglang=={SGLANG_VERSION}"

# Real SGLang files the loader imports (directories end with "/"). Everything else SGLang
# imports is a stand-in (see standins.py).
EXTRACT = (
    "sglang/srt/mem_cache/",
    "sglang/srt/managers/schedule_policy.py",
    "sglang/srt/managers/schedule_batch.py",
    "sglang/srt/constants.py",  # one string constant
    "sglang/srt/environ.py",  # `envs`, stdlib only
    "sglang/srt/sampling/sampling_params.py",  # `SamplingParams`, stdlib only
    "sglang/srt/disaggregation/utils.py",  # `DisaggregationMode`, torch only
    "sglang/srt/utils/torch_memory_saver_adapter.py",  # no-op adapter when the package is absent
    # Read (not imported) by the stand-ins, which execute a few of their functions and classes:
    "sglang/srt/utils/common.py",
    "sglang/srt/model_executor/forward_batch_info.py",
)
# 0.5.23 imports several hundred of its own modules (see `reference.v0523.loader`): the
# runtime and the kernels' Python sources; of the compiled parts only the Rust tree core
# (under mem_cache/), not the server, gRPC, bench and multimodal extensions.
EXTRACT_0523 = ("sglang/__init__.py", "sglang/srt/", "sglang/kernels/")
SKIP_0523 = tuple(f"sglang/srt/rust_extensions/_{name}." for name in ("bench", "grpc", "multimodal", "server"))
_MARKER = ".memcli-extracted"

# Real vLLM 0.33.0 files: those its KV-cache manager and v1 scheduler import, and those the
# stand-ins borrow definitions from (`memcli.reference.vllm_standins`).
VLLM_EXTRACT = (
    "vllm/v1/core/",
    "vllm/v1/kv_cache_interface.py", "vllm/v1/kv_cache_spec_registry.py", "vllm/v1/kv_cache_layout.py",
    "vllm/v1/request.py", "vllm/v1/outputs.py", "vllm/v1/metrics/stats.py", "vllm/v1/metrics/cache_hit_source.py",
    "vllm/v1/hisparse/block_pool.py", "vllm/v1/attention/backends/registry.py",
    "vllm/utils/", "vllm/envs.py", "vllm/logger.py", "vllm/logging_utils/",
    # Read (not imported) by the stand-ins:
    "vllm/distributed/kv_events.py", "vllm/v1/engine/__init__.py", "vllm/v1/utils.py",
    "vllm/multimodal/utils.py",
)


@dataclass(frozen=True)
class Wheel:
    """One engine's pinned wheel: `pip download --no-deps <package>==<version>`, and the
    members to unpack (directories end with "/"; with `python_only`, only their `.py` files;
    members under a `skip` prefix are left out). `python_tag` / `platform`: the pip
    arguments for a binary-only wheel when this interpreter is not the one it was built for."""

    package: str
    version: str
    extract: tuple[str, ...]
    label: str  # how messages name the engine
    python_only: bool = True
    skip: tuple[str, ...] = ()
    python_tag: Optional[str] = None  # "3.11": cp311 only
    platform: Optional[str] = None

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def stem(self) -> str:
        return f"{self.package}-{self.version}"


SGLANG = Wheel("sglang", SGLANG_VERSION, EXTRACT, "SGLang", python_only=False)
SGLANG_0523_WHEEL = Wheel("sglang", SGLANG_0523, EXTRACT_0523, "SGLang", python_only=False, skip=SKIP_0523,
                          python_tag="3.11", platform="manylinux_2_34_x86_64")
VLLM = Wheel("vllm", "0.33.0", VLLM_EXTRACT, "vLLM")
WHEELS = {SGLANG_VERSION: SGLANG, SGLANG_0523: SGLANG_0523_WHEEL}  # SGLang's, by version
WheelLike = Union[Wheel, str]  # a Wheel, or an SGLang version


def wheel_spec(which: WheelLike = SGLANG) -> Wheel:
    """The `Wheel` itself, or SGLang's of that version; an unknown version is a `ValueError`."""
    if isinstance(which, Wheel):
        return which
    spec = WHEELS.get(which)
    if spec is None:
        raise ValueError(f"no SGLang reference for version {which!r} (known: {', '.join(WHEELS)})")
    return spec

# pip's messages when the index cannot be reached (as opposed to a broken pip or package).
_NETWORK_SIGNS = (
    "Could not find a version that satisfies",
    "No matching distribution found",
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
    "SSLError",
)


class ReferenceFetchError(MemcliError):
    """An engine's wheel could not be downloaded or unpacked.

    `network` is True when pip's output says the package index could not be reached
    (tests skip then; any other failure is a real error).
    """

    def __init__(self, message: str, hint: Optional[str] = None, network: bool = False):
        super().__init__(message, hint)
        self.network = network


def default_cache_dir() -> Path:
    """`$MEMCLI_CACHE_DIR`, else `~/.cache/memcli` (not created here)."""
    env = os.environ.get("MEMCLI_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "memcli"


def reference_dir(cache_dir: Optional[Path] = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "reference"


def _find_wheel(directory: Path, wheel: WheelLike = SGLANG) -> Optional[Path]:
    wheels = sorted(directory.glob(f"{wheel_spec(wheel).stem}-*.whl"))
    return wheels[0] if wheels else None


def cached_wheel(cache_dir: Optional[Path] = None, wheel: WheelLike = SGLANG) -> Optional[Path]:
    """The cached wheel (sglang 0.5.5 by default), or None (nothing is downloaded)."""
    return _find_wheel(reference_dir(cache_dir), wheel)


def fetch_wheel(cache_dir: Optional[Path] = None, wheel: WheelLike = SGLANG) -> Path:
    """Path of the wheel (sglang 0.5.5 by default), downloading it into the cache when absent.

    Runs `python -m pip download --no-deps <package>==<version>` only when no wheel is cached.
    Raises `ReferenceFetchError` (with `network=True` when the index is unreachable).
    """
    wheel = wheel_spec(wheel)
    directory = reference_dir(cache_dir)
    cached = _find_wheel(directory, wheel)
    if cached is not None:
        return cached
    directory.mkdir(parents=True, exist_ok=True)
    _pip_download(directory, wheel)
    found = _find_wheel(directory, wheel)
    if found is None:
        raise ReferenceFetchError(f"pip reported success but no {wheel.stem} wheel is in {directory}",
                                  hint="remove the directory and try again")
    return found


def _pip_command(directory: Path, wheel: Wheel) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--timeout", "30", "--retries", "2"]
    if wheel.python_tag is not None and f"{sys.version_info[0]}.{sys.version_info[1]}" != wheel.python_tag:
        cmd += ["--python-version", wheel.python_tag]
    if wheel.platform is not None:
        cmd += ["--platform", wheel.platform]
    return [*cmd, wheel.requirement, "-d", str(directory)]


def _pip_download(directory: Path, wheel: Wheel) -> None:
    requirement, cmd = wheel.requirement, _pip_command(directory, wheel)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ReferenceFetchError(f"could not run pip to download {requirement}: {exc}",
                                  hint="check that pip is installed in this Python") from exc
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip()
        network = any(sign in output for sign in _NETWORK_SIGNS)
        tail = "\n".join(output.splitlines()[-5:])
        hint = ("the package index could not be reached; connect to the network, or put the wheel"
                f" into {directory}" if network else "run the pip command by hand to see the full error")
        raise ReferenceFetchError(f"pip download {requirement} failed (exit {proc.returncode}): {tail}",
                                  hint=hint, network=network)


def _members(names: list[str], want: str, wheel: Wheel) -> list[str]:
    if not want.endswith("/"):
        return [n for n in names if n == want]
    return [n for n in names if n.startswith(want) and (not wheel.python_only or n.endswith(".py"))
            and not n.startswith(wheel.skip)]


def extract(path: Path, cache_dir: Optional[Path] = None, wheel: WheelLike = SGLANG) -> Path:
    """Unpack the `wheel.extract` subset of the wheel file `path`; return the root to import
    the package from (`Wheel.python_only`, `Wheel.skip` say what comes from directories).

    Idempotent: a marker file records a finished extraction. Raises `ReferenceFetchError`
    when the wheel is unreadable or lacks one of the files.
    """
    wheel = wheel_spec(wheel)
    root = reference_dir(cache_dir) / wheel.stem
    if (root / _MARKER).exists():
        return root
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            for want in wheel.extract:
                members = _members(names, want, wheel)
                if not members:
                    raise ReferenceFetchError(f"{path.name} has no {want}", hint="delete the wheel to download it again")
                for member in members:
                    zf.extract(member, root)
    except zipfile.BadZipFile as exc:
        raise ReferenceFetchError(f"{path} is not a valid wheel: {exc}", hint="delete it to download it again") from exc
    (root / _MARKER).write_text(wheel.requirement + "\n")
    return root


def fetch_reference(cache_dir: Optional[Path] = None, wheel: WheelLike = SGLANG) -> Path:
    """Download (if needed) and extract; return the extracted root."""
    return extract(fetch_wheel(cache_dir, wheel), cache_dir, wheel)


def interpreter_mismatch(wheel: WheelLike = SGLANG) -> Optional[str]:
    """Why this Python cannot import the wheel's compiled parts (None when it can)."""
    wheel = wheel_spec(wheel)
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if wheel.python_tag is not None and here != wheel.python_tag:
        return f"the {wheel.label} {wheel.version} wheel is built for CPython {wheel.python_tag} only (this is {here})"
    return None


@lru_cache(maxsize=None)
def _availability(cache_dir: Optional[Path], wheel: Wheel) -> Optional[str]:
    mismatch = interpreter_mismatch(wheel)
    if mismatch is not None:
        return mismatch
    try:
        fetch_reference(cache_dir, wheel)
    except ReferenceFetchError as exc:
        if exc.network:
            return f"{wheel.label} {wheel.version} wheel unavailable (package index unreachable): {exc.message}"
        raise
    return None


def unavailable_reason(cache_dir: Optional[Path] = None, wheel: WheelLike = SGLANG) -> Optional[str]:
    """None when the reference is ready; a reason string when the package index cannot be
    reached or the wheel has no build for this Python. Any other failure (a broken pip, a bad wheel) raises: tests must not hide it."""
    return _availability(Path(cache_dir) if cache_dir else None, wheel_spec(wheel))


def reference_available(cache_dir: Optional[Path] = None, wheel: WheelLike = SGLANG) -> bool:
    return unavailable_reason(cache_dir, wheel) is None
