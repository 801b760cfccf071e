"""Which attention backend SGLang 0.5.5 runs, as its server picks it, for the reference.

SGLang's memory path reads one server argument, `attention_backend`: in
`mem_cache/common.py`, `write_cache_indices` takes the Triton kernel
`write_req_to_token_pool_triton` when `support_triton(attention_backend)` holds (every
backend but torch_native, intel_amx and ascend), else a Python loop of per-request writes;
`get_last_loc` takes `get_last_loc_triton` unless the backend is ascend or torch_native.

A server left to choose (`ServerArgs._handle_attention_backend_compatibility`, for a model of
a default FA3 architecture such as Llama with no speculative decoding) takes:

    CUDA, compute capability 9.x (Hopper), CUDA >= 12.3     fa3
    other CUDA devices                                       flashinfer when installed, else triton
    CPU                                                      intel_amx (torch_native without AMX)

On a CPU the reference runs torch_native: SGLang's own fallback when the CPU has no AMX, and
the only one the Triton interpreter can run (its Triton write path reads pointers out of a
tensor). intel_amx takes the same memory path there (`support_triton` is false for both).
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple, Optional

import torch

from memcli.errors import MemcliError

FALLBACK = "torch_native"
# SGLang 0.5.5's attention backends (`ATTENTION_BACKEND_CHOICES` of server_args.py).
KNOWN = ("triton", "torch_native", "flex_attention", "nsa", "cutlass_mla", "fa3", "fa4", "flashinfer", "flashmla",
         "trtllm_mla", "trtllm_mha", "dual_chunk_flash_attn", "aiter", "wave", "intel_amx", "ascend", "intel_xpu")
# Backends whose memory path is SGLang's torch fallback (`support_triton` false).
NO_TRITON = ("torch_native", "intel_amx", "ascend")


class BackendChoice(NamedTuple):
    """The attention backend the reference runs, and why."""

    name: str
    default: bool  # what SGLang picks by default on this device (False: asked for)

    @property
    def triton_paths(self) -> bool:
        """True when SGLang's memory path takes its Triton kernels (`support_triton`)."""
        return self.name not in NO_TRITON

    @property
    def label(self) -> str:
        """One line for tables and JSON: the name, and whether it is the device's default."""
        if self.name == FALLBACK and not self.default:
            return f"{self.name} (SGLang's fallback path, asked for)"
        why = "SGLang's default on this device" if self.default else "asked for"
        paths = "Triton write paths" if self.triton_paths else "torch write paths"
        return f"{self.name} ({why}; {paths})"


def default_backend(device_type: str, capability: Optional[tuple[int, int]] = None,
                    cuda_version: Optional[str] = None, flashinfer: Optional[bool] = None) -> str:
    """SGLang 0.5.5's default attention backend for a Llama-type model on this device.

    `capability`, `cuda_version`, `flashinfer`: the device's compute capability, torch's CUDA
    version and whether flashinfer is importable (None: read from this process)."""
    if device_type != "cuda":
        return FALLBACK
    if capability is None:
        capability = torch.cuda.get_device_capability()
    if cuda_version is None:
        cuda_version = torch.version.cuda or "0.0"
    if capability[0] == 9 and tuple(int(x) for x in cuda_version.split(".")[:2]) >= (12, 3):
        return "fa3"
    if flashinfer is None:
        flashinfer = importlib.util.find_spec("flashinfer") is not None
    return "flashinfer" if flashinfer else "triton"


def choose_backend(device_type: str, asked: Optional[str] = None) -> BackendChoice:
    """The backend the reference runs on `device_type`: SGLang's default, or `asked`.

    Raises `MemcliError` for an unknown name, or a Triton-path backend without CUDA (the
    interpreter cannot run SGLang's Triton write path)."""
    if asked is not None and asked not in KNOWN:
        raise MemcliError(f"--compare-backend {asked!r}: not an attention backend of SGLang 0.5.5",
                          hint=f"use one of {', '.join(KNOWN)}")
    default = default_backend(device_type)
    if asked is None or asked == default:
        return BackendChoice(default, True)
    if device_type != "cuda" and asked not in NO_TRITON:
        raise MemcliError(f"--compare-backend {asked}: its Triton write path needs CUDA (this run is on"
                          f" {device_type})", hint=f"on a CPU use {' or '.join(NO_TRITON[:2])}")
    return BackendChoice(asked, False)
