"""Where a stack runs: the device and the kernel backend a config resolves to."""

from __future__ import annotations

import os

import torch

from memcli.config import Config
from memcli.errors import ConfigError


def resolve_device(config: Config) -> torch.device:
    want = config.runtime.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("runtime.device: cuda requested but no CUDA device is visible",
                          hint="use --set runtime.device=cpu (or auto)")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def resolve_backend(config: Config, device: torch.device) -> str:
    backend = config.runtime.kernel_backend
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("runtime.kernel_backend: triton needs a CUDA device (or TRITON_INTERPRET=1)",
                              hint="use --set runtime.kernel_backend=torch on a CPU")
    return backend
