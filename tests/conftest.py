import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_require_gpu = False   # --require-gpu (set in pytest_configure)


def pytest_addoption(parser):
    parser.addoption("--require-gpu", action="store_true", default=False,
                     help="fail, instead of skipping, every test that needs a GPU (or a GPU peer such as FLA) "
                          "this machine lacks: the GPU machine's runs use it, so no GPU test is left out silently")


def pytest_configure(config):
    global _require_gpu
    _require_gpu = config.getoption("--require-gpu")


def gpu_arch():
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}.get((major, minor))


# GPU tests carry the `gpu` mark (arch=...: one arch, "sm_100a" standing for the SM100 family, sm_103a too);
# pytest_runtest_setup skips them where the GPU is missing, or fails them with --require-gpu.
requires_gpu = pytest.mark.gpu
requires_sm90 = pytest.mark.gpu(arch="sm_90a")


def pytest_runtest_setup(item):
    for mark in item.iter_markers("gpu"):
        want, have = mark.kwargs.get("arch"), gpu_arch()
        family = "sm_100a" if have == "sm_103a" else have
        if have is None or (want is not None and family != want):
            kind = {"sm_90a": "an SM90 (Hopper)", "sm_100a": "an SM100 (Blackwell)"}.get(want, "an SM90 or SM100")
            reason = f"needs {kind} CUDA GPU, found {have or 'none'}"
            if _require_gpu:
                pytest.fail(f"{reason} (--require-gpu)", pytrace=False)
            pytest.skip(reason)


def import_peer(module: str):
    """A peer library's module (e.g. FLA's): the test is skipped where it is not installed, and fails with
    --require-gpu (the GPU machine's wheelhouse has the peers)."""
    if _require_gpu:
        import importlib

        return importlib.import_module(module)
    return pytest.importorskip(module)


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def poisoned(shape, dtype, device):
    """An output buffer full of NaN (or a huge value for integer dtypes): unwritten elements show."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.fill_(float("nan") if dtype.is_floating_point else 2**30)
    return t
