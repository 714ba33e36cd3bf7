"""Input checks shared by the ops: every message names the argument."""

from __future__ import annotations

import torch

from .runtime.arch import device_arch


def check_tensor(name: str, t, *, dtypes=None, ndim=None, min_ndim=None, contiguous=True, align=16):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")
    if align and t.is_cuda and t.data_ptr() % align:
        raise ValueError(f"{name} must start at a {align}-byte aligned address (a sliced view is not)")
    return t


def check_shape(name: str, t: torch.Tensor, shape: tuple):
    if t.shape != (shape if isinstance(shape, tuple) else tuple(shape)):   # torch.Size == a tuple of ints
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_qkv(q, k, v, io_dtypes, head_dims) -> tuple[int, int, int, int, int, int]:
    """q, k [B, T, H, K] and v [B, T, HV, V] of one dtype, HV a multiple of H (GVA), K and V in `head_dims`;
    returns (B, T, H, K, HV, V)."""
    check_tensor("q", q, dtypes=io_dtypes, ndim=4)
    B, T, H, K = q.shape
    check_tensor("k", k, dtypes=(q.dtype,), ndim=4)
    check_shape("k", k, (B, T, H, K))
    check_tensor("v", v, dtypes=(q.dtype,), ndim=4)
    HV, V = v.shape[2], v.shape[3]
    check_shape("v", v, (B, T, HV, V))
    if H < 1 or HV % H:
        raise ValueError(f"v's heads (HV = {HV}) must be a multiple of q's and k's (H = {H}) (GVA)")
    if K not in head_dims or V not in head_dims:
        raise ValueError(f"head dims K={K}, V={V} are not supported: supported are {tuple(head_dims)}")
    return B, T, H, K, HV, V


def check_no_grad(op: str, **tensors) -> None:
    """The ops are forward-only: under grad mode an input that requires grad would get an output without a graph
    (its gradient silently lost), so it raises instead, naming the input."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise RuntimeError(f"{op} is forward-only, but {name} requires grad: call it under torch.no_grad() or "
                               f"torch.inference_mode() (or detach {name}); for training use FLA")


def check_cuda(**tensors) -> torch.device:
    """All tensors on one CUDA device of a supported arch; returns that device."""
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not t.is_cuda:
            raise ValueError(f"{name} must be on a CUDA device, got {t.device} (the references in "
                             f"cute_kernels.reference run on the CPU)")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    device_arch(device)
    return device


_offsets_cache: dict = {}


def offsets_tensor(name: str, offsets, slots: int, device) -> tuple[torch.Tensor, int]:
    """`offsets` (list, tuple or 1-D int tensor [N+1]) as an int32 tensor on `device`, and N. A list/tuple or CPU
    tensor is checked fully (starts at 0, non-decreasing, ends at `slots`) and copied once per distinct value
    (cached: a copy per call would stall the stream); a CUDA tensor only by dtype and rank (no device sync)."""
    if isinstance(offsets, (list, tuple)) or (isinstance(offsets, torch.Tensor) and not offsets.is_cuda):
        vals = tuple(int(x) for x in (offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets))
        key = (vals, slots, str(device))
        hit = _offsets_cache.get(key)
        if hit is not None:
            return hit, len(vals) - 1
        if len(vals) < 2 or vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])) or vals[-1] != slots:
            raise ValueError(f"{name} must start at 0, be non-decreasing and end at {slots}, got {list(vals[:8])}"
                             f"{'...' if len(vals) > 8 else ''}")
        if len(_offsets_cache) >= 256:
            _offsets_cache.clear()
        _offsets_cache[key] = torch.tensor(vals, dtype=torch.int32, device=device)
        return _offsets_cache[key], len(vals) - 1
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name} must be a list of ints or a 1-D integer tensor, got {type(offsets).__name__}")
    if offsets.dtype not in (torch.int32, torch.int64) or offsets.dim() != 1 or offsets.numel() < 2:
        raise TypeError(f"{name} must be a 1-D int32/int64 tensor with >= 2 entries, got {offsets.dtype} "
                        f"{tuple(offsets.shape)}")
    if offsets.device != device:
        raise ValueError(f"{name} is on {offsets.device} but the other inputs are on {device}")
    return offsets.to(torch.int32).contiguous(), offsets.numel() - 1
