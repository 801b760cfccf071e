"""Obtain an SGLang wheel from PyPI and unpack the files its reference needs.

Layout of the cache (never inside the repository), one wheel per version (`WHEELS`):

    <cache_dir>/reference/sglang-0.5.5-py3-none-any.whl    the wheel, as pip downloaded it
    <cache_dir>/reference/sglang-0.5.5/sglang/srt/...       the extracted subset (its `extract`)
    <cache_dir>/reference/sglang-0.5.23-cp311-...whl       0.5.23 (cp311 only: compiled Rust parts)
    <cache_dir>/reference/sglang-0.5.23/sglang/...

Every function takes `version` (default `SGLANG_VERSION`, 0.5.5).

`cache_dir` is `$MEMCLI_CACHE_DIR`, else `~/.cache/memcli`. The wheel is downloaded once
(`python -m pip download --no-deps`) and reused; extraction is redone only when its marker
file is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple, Optional

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


class WheelSpec(NamedTuple):
    """One version's wheel: what to ask pip for and what to unpack from it."""

    version: str
    extract: tuple[str, ...]
    skip: tuple[str, ...] = ()  # member prefixes left out of the `extract` directories
    # pip arguments for a binary-only wheel when this interpreter is not the one it was built for
    python_tag: Optional[str] = None  # "3.11": cp311 only
    platform: Optional[str] = None

    @property
    def requirement(self) -> str:
        return f"sglang=={self.version}"


WHEELS = {
    SGLANG_VERSION: WheelSpec(SGLANG_VERSION, EXTRACT),
    SGLANG_0523: WheelSpec(SGLANG_0523, EXTRACT_0523, SKIP_0523, python_tag="3.11",
                           platform="manylinux_2_34_x86_64"),
}
_MARKER = ".memcli-extracted"

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
    """The SGLang wheel could not be downloaded or unpacked.

    `network` is True when pip's output says the package index could not be reached
    (tests skip then; any other failure is a real error).
    """

    def __init__(self, message: str, hint: Optional[str] = None, network: bool = False):
        super().__init__(message, hint)
        self.network = network


def wheel_spec(version: str = SGLANG_VERSION) -> WheelSpec:
    """The `WheelSpec` of `version`; a version memcli has no reference for is a `ValueError`."""
    spec = WHEELS.get(version)
    if spec is None:
        raise ValueError(f"no SGLang reference for version {version!r} (known: {', '.join(WHEELS)})")
    return spec


def default_cache_dir() -> Path:
    """`$MEMCLI_CACHE_DIR`, else `~/.cache/memcli` (not created here)."""
    env = os.environ.get("MEMCLI_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "memcli"


def reference_dir(cache_dir: Optional[Path] = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "reference"


def _find_wheel(directory: Path, version: str = SGLANG_VERSION) -> Optional[Path]:
    wheels = sorted(directory.glob(f"sglang-{version}-*.whl"))
    return wheels[0] if wheels else None


def cached_wheel(cache_dir: Optional[Path] = None, version: str = SGLANG_VERSION) -> Optional[Path]:
    """The cached sglang wheel of `version`, or None (nothing is downloaded)."""
    return _find_wheel(reference_dir(cache_dir), version)


def fetch_wheel(cache_dir: Optional[Path] = None, version: str = SGLANG_VERSION) -> Path:
    """Path of the sglang wheel of `version`, downloading it into the cache when absent.

    Runs `python -m pip download --no-deps sglang==<version>` only when no wheel is cached.
    Raises `ReferenceFetchError` (with `network=True` when the index is unreachable).
    """
    spec = wheel_spec(version)
    directory = reference_dir(cache_dir)
    cached = _find_wheel(directory, version)
    if cached is not None:
        return cached
    directory.mkdir(parents=True, exist_ok=True)
    _pip_download(directory, spec)
    wheel = _find_wheel(directory, version)
    if wheel is None:
        raise ReferenceFetchError(f"pip reported success but no sglang-{version} wheel is in {directory}",
                                  hint="remove the directory and try again")
    return wheel


def _pip_command(directory: Path, spec: WheelSpec) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--timeout", "30", "--retries", "2"]
    if spec.python_tag is not None and f"{sys.version_info[0]}.{sys.version_info[1]}" != spec.python_tag:
        cmd += ["--python-version", spec.python_tag]
    if spec.platform is not None:
        cmd += ["--platform", spec.platform]
    return [*cmd, spec.requirement, "-d", str(directory)]


def _pip_download(directory: Path, spec: WheelSpec) -> None:
    requirement = spec.requirement
    cmd = _pip_command(directory, spec)
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


def extract(wheel: Path, cache_dir: Optional[Path] = None, version: str = SGLANG_VERSION) -> Path:
    """Unpack the `extract` subset of `wheel` (its version's `WheelSpec`); return the root
    to import `sglang` from.

    Idempotent: a marker file records a finished extraction. Raises `ReferenceFetchError`
    when the wheel is unreadable or lacks one of the files.
    """
    spec = wheel_spec(version)
    root = reference_dir(cache_dir) / f"sglang-{version}"
    if (root / _MARKER).exists():
        return root
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            for want in spec.extract:
                members = [n for n in names if n == want or (want.endswith("/") and n.startswith(want)
                                                              and not n.startswith(spec.skip))]
                if not members:
                    raise ReferenceFetchError(f"{wheel.name} has no {want}", hint="delete the wheel to download it again")
                for member in members:
                    zf.extract(member, root)
    except zipfile.BadZipFile as exc:
        raise ReferenceFetchError(f"{wheel} is not a valid wheel: {exc}", hint="delete it to download it again") from exc
    (root / _MARKER).write_text(spec.requirement + "\n")
    return root


def fetch_reference(cache_dir: Optional[Path] = None, version: str = SGLANG_VERSION) -> Path:
    """Download (if needed) and extract; return the extracted root."""
    return extract(fetch_wheel(cache_dir, version), cache_dir, version)


def interpreter_mismatch(version: str = SGLANG_VERSION) -> Optional[str]:
    """Why this Python cannot import `version`'s compiled wheel (None when it can)."""
    spec = wheel_spec(version)
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if spec.python_tag is not None and here != spec.python_tag:
        return f"the SGLang {version} wheel is built for CPython {spec.python_tag} only (this is {here})"
    return None


@lru_cache(maxsize=None)
def _availability(cache_dir: Optional[Path], version: str) -> Optional[str]:
    mismatch = interpreter_mismatch(version)
    if mismatch is not None:
        return mismatch
    try:
        fetch_reference(cache_dir, version)
    except ReferenceFetchError as exc:
        if exc.network:
            return f"SGLang {version} wheel unavailable (package index unreachable): {exc.message}"
        raise
    return None


def unavailable_reason(cache_dir: Optional[Path] = None, version: str = SGLANG_VERSION) -> Optional[str]:
    """None when the reference is ready; a reason string when the package index cannot be
    reached or the wheel has no build for this Python. Any other failure (a broken pip, a
    bad wheel) raises: tests must not hide it."""
    return _availability(Path(cache_dir) if cache_dir else None, version)


def reference_available(cache_dir: Optional[Path] = None, version: str = SGLANG_VERSION) -> bool:
    return unavailable_reason(cache_dir, version) is None
