"""Input validation and small helpers shared by the kernel launchers.

Every public op validates its inputs the same way for both backends, so a bad call fails
with the same ``ValueError`` whether it runs through Triton or through the torch reference.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch

BACKENDS = ("triton", "torch")


def cdiv(a, b):
    """Ceiling division for ints and integer tensors (non-negative numerators)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2`` gives, in
    plain integer arithmetic: Triton's is a constexpr function, several microseconds per
    host call."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``out[i] = sum(x[:i])``, computed on x's device without a host sync."""
    return torch.cumsum(x, dim=0) - x


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_page_size(page_size) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")


def check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def check_tensor(
    name: str,
    t,
    *,
    dtype: Optional[torch.dtype] = torch.int64,
    ndim: int = 1,
    device: Optional[torch.device] = None,
    length: Optional[int] = None,
    contiguous: bool = False,
    length_of: str = "batch size",
) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``t`` matches every given requirement."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all inputs on one device)")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have length {length} ({length_of}), got {t.shape[0]}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_triton_device(device: torch.device, kernel) -> None:
    """Compiled Triton kernels need CUDA tensors; the interpreter runs on any device."""
    if device.type != "cuda" and not is_interpreted(kernel):
        raise ValueError(
            f"the triton backend needs CUDA tensors, got {device} "
            "(use backend='torch', or set TRITON_INTERPRET=1 before importing the kernels)"
        )


def is_interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def num_compiled_variants(kernel, device: torch.device) -> Optional[int]:
    """How many binaries the JIT cache holds for ``kernel`` on ``device`` (None if unknown)."""
    if device.type != "cuda":
        return None
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        caches = kernel.device_caches.get(index)
        return 0 if caches is None else len(caches[0])
    except (AttributeError, IndexError, TypeError):
        return None


class Launcher:
    """Calls a ``@triton.jit`` kernel, then launches its compiled binary directly.

    A call through the JIT binds and specialises every argument before the launch, several
    microseconds of host time that the memory path pays on every step. When the binary can
    only depend on the current device, the constexpr values, the tensors' dtypes and the
    integers' widths, the launcher keeps the binary the JIT returned under that key and
    afterwards calls its launch function directly, on the current device's current stream
    (as the JIT does). That holds when every runtime parameter is listed
    in both ``do_not_specialize`` and ``do_not_specialize_on_alignment``. Otherwise, under
    the interpreter, while launch hooks (profilers) are installed, or with a Triton whose
    compiled kernels lack the launch attributes, every call goes through the JIT.

    Arguments are passed positionally, constexprs included, in the kernel's parameter order.
    A call whose arguments change kind (a tensor where an int was) goes through the JIT.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self._binaries: dict[tuple, object] = {}
        self._direct = not is_interpreted(kernel) and _unspecialised(kernel)
        self._constexpr = [p.is_constexpr for p in kernel.params] if self._direct else []
        self._tensors: tuple[int, ...] = ()  # positions of tensor arguments (set by the first call)
        self._ints: tuple[int, ...] = ()  # positions of runtime int arguments
        self._pick = None  # the pickers of those positions and of the constexprs (set by the first call)
        self._constexprs = tuple(i for i, c in enumerate(self._constexpr) if c)

    @property
    def direct(self) -> bool:
        """True while calls after the first of each key skip the JIT."""
        return self._direct

    def __call__(self, grid: tuple, *args) -> None:
        if not self._direct:
            self.kernel[grid](*args)
            return
        if self._pick is None:
            self._classify(args)
        # Like the JIT, launch on the current device's current stream.
        device = torch._C._cuda_getDevice()
        try:
            key = (device, *self._key(args))
        except (AttributeError, RuntimeError, TypeError):  # an argument changed kind: the JIT decides
            key = None
        binary = self._binaries.get(key) if key is not None else None
        if binary is None or _launch_hooks_installed():
            binary = self.kernel[grid](*args)
            if not _has_launch_attributes(binary):
                self._direct = False
            elif key is not None:
                self._binaries[key] = binary
            return
        gx, gy, gz = (*grid, 1, 1)[:3]
        binary.run(gx, gy, gz, torch._C._cuda_getCurrentRawStream(device), binary.function, binary.packed_metadata,
                   None, None, None, *args)

    def _classify(self, args) -> None:
        runtime = [i for i, c in enumerate(self._constexpr) if not c]
        self._tensors = tuple(i for i in runtime if isinstance(args[i], torch.Tensor))
        self._ints = tuple(i for i in runtime if i not in self._tensors)
        self._pick = (_picker(self._tensors), _picker(self._ints), _picker(self._constexprs))

    def _key(self, args) -> tuple:
        """What the binary depends on besides the device: the tensors' dtypes, each int's width
        (an unannotated int is i32 or i64 by its value) and the constexpr values."""
        tensors, ints, constexprs = self._pick
        return (*map(_dtype, tensors(args)), *[-(2**31) <= i < 2**31 for i in ints(args)], *constexprs(args))


_dtype = operator.attrgetter("dtype")


def _picker(positions: tuple[int, ...]):
    """A function giving the arguments at ``positions`` as a tuple (``itemgetter`` gives a
    bare value for one position)."""
    if len(positions) == 1:
        (i,) = positions
        return lambda args: (args[i],)
    return operator.itemgetter(*positions) if positions else lambda args: ()


def _unspecialised(kernel) -> bool:
    """Every runtime parameter exempt from value and alignment specialisation."""
    try:
        return all(p.is_constexpr or (p.do_not_specialize and p.do_not_specialize_on_alignment)
                   for p in kernel.params)
    except AttributeError:
        return False


def _has_launch_attributes(binary) -> bool:
    return all(getattr(binary, name, None) is not None for name in ("run", "function", "packed_metadata"))


def _launch_hooks_installed() -> bool:
    """True when a launch hook (a profiler) is installed: then every call goes through the JIT,
    which passes the hooks their metadata. Newer Tritons keep hooks in an always-present
    chain, empty when nothing is installed; older ones use None."""
    if _knobs is None:  # a Triton without knobs: keep to the JIT
        return True
    for hook in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


try:
    from triton import knobs as _knobs
except ImportError:
    _knobs = None
