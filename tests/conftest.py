import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def gpu_arch():
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_100a"}.get((major, minor))


requires_gpu = pytest.mark.skipif(gpu_arch() is None, reason="needs an SM90 or SM100 CUDA GPU")


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def poisoned(shape, dtype, device):
    """An output buffer full of NaN (or a huge value for integer dtypes): unwritten elements show."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.fill_(float("nan") if dtype.is_floating_point else 2**30)
    return t
