"""Which GPU architecture we compile for, and importing CuTe DSL with it set: CuTe DSL reads `CUTE_DSL_ARCH` when
`cutlass` is first imported. On a GPU machine we set it from the device's compute capability; on a CPU-only machine
the caller sets it (`sm_90a`, `sm_100a` or `sm_103a`). Nothing here launches work on a GPU.
"""

from __future__ import annotations

import os

SUPPORTED_ARCHS = ("sm_90a", "sm_100a", "sm_103a")
SM100_ARCHS = ("sm_100a", "sm_103a")   # B200 / GB200 and B300 / GB300: the same tcgen05 kernels, built per arch


class UnsupportedDeviceError(RuntimeError):
    """No usable GPU: not CUDA, or not SM90 / SM100."""


def arch_of_capability(major: int, minor: int) -> str | None:
    if (major, minor) == (9, 0):
        return "sm_90a"
    if (major, minor) == (10, 0):
        return "sm_100a"
    if (major, minor) == (10, 3):   # an sm_100a cubin does not load here: the "a" features are per arch
        return "sm_103a"
    return None


_arch_by_device: dict = {}


def device_arch(device=None) -> str:
    """The arch string of a CUDA device (cached per device); raises UnsupportedDeviceError if unsupported."""
    hit = _arch_by_device.get(device)
    if hit is not None:
        return hit
    arch = _query_device_arch(device)
    _arch_by_device[device] = arch
    return arch


def _query_device_arch(device) -> str:
    import torch

    if not torch.cuda.is_available():
        raise UnsupportedDeviceError(
            "no CUDA GPU is available: cute_kernels ops need an SM90 (Hopper) or SM100 (Blackwell) GPU; "
            "the float64 references in cute_kernels.reference run anywhere"
        )
    major, minor = torch.cuda.get_device_capability(device)
    arch = arch_of_capability(major, minor)
    if arch is None:
        raise UnsupportedDeviceError(
            f"GPU {torch.cuda.get_device_name(device)} is sm_{major}{minor}: cute_kernels supports "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )
    return arch


def target_arch() -> str:
    """The arch CuTe DSL compiles for in this process: `CUTE_DSL_ARCH` if set, else the current GPU's."""
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        if env not in SUPPORTED_ARCHS:
            raise UnsupportedDeviceError(f"CUTE_DSL_ARCH={env!r}: supported are {SUPPORTED_ARCHS}")
        return env
    return device_arch()


def import_cutlass():
    """Import `cutlass` with `CUTE_DSL_ARCH` set (from the GPU when the caller did not set it)."""
    import sys

    if "cutlass" not in sys.modules:
        os.environ.setdefault("CUTE_DSL_ARCH", target_arch())
    import cutlass

    return cutlass


_sm_counts: dict = {}
_kinds: dict = {}


def sm_count(device) -> int:
    """The device's SM count (queried once per device)."""
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_counts:
        _sm_counts[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_counts[idx]


def device_kind(device) -> str:
    """The device's entry in the planner's calibration table: "H100", "H200" or "SM100" (queried once)."""
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _kinds:
        name = torch.cuda.get_device_name(idx)
        _kinds[idx] = ("H200" if "H200" in name else "H100" if "H100" in name
                       else "SM100" if device_arch(device) in SM100_ARCHS else "H200")
    return _kinds[idx]
