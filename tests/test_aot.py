"""Compiled kernels on disk (`cute_kernels/runtime/aot.py`): export, then load in a fresh process, on the CPU; the
GPU test runs the loaded kernel beside the JIT-compiled one."""

import os
import subprocess
import sys

import torch
from conftest import requires_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from cute_kernels.kernels.build import build_lse_merge as compile_lse_merge
from cute_kernels.runtime import aot
import cute_kernels.runtime.compile as rc
fn = compile_lse_merge(128, torch.bfloat16).fn
print("loaded" if type(fn).__module__.startswith("tvm_ffi") else "compiled")
key = next(iter(rc._cache))
print(aot.load(key + ("other",)) is None)
"""


def run(env_extra, tmp_path):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", **env_extra)
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(root=ROOT)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout.split()


def test_aot_export_then_load(tmp_path):
    """The first process compiles and exports (CUTE_KERNELS_AOT_WRITE=1), the second loads the object file
    instead of compiling; a key it never saw misses; without CUTE_KERNELS_AOT_DIR nothing is read."""
    aot_dir = str(tmp_path / "aot")
    assert run({"CUTE_KERNELS_AOT_DIR": aot_dir, "CUTE_KERNELS_AOT_WRITE": "1"}, tmp_path) == ["compiled", "True"]
    files = os.listdir(aot_dir)
    assert len(files) == 1 and files[0].startswith("ck_") and files[0].endswith(".o")
    assert run({"CUTE_KERNELS_AOT_DIR": aot_dir}, tmp_path) == ["loaded", "True"]
    env = {k: v for k, v in os.environ.items() if k != "CUTE_KERNELS_AOT_DIR"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(root=ROOT)], env=dict(env, CUTE_DSL_ARCH="sm_90a"),
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.split()[0] == "compiled", proc.stderr[-2000:]


@requires_gpu
def test_aot_kernel_equals_jit(tmp_path, monkeypatch):
    """A kernel exported and loaded back runs like the JIT-compiled one: lse_merge's outputs bitwise equal."""
    from cute_kernels.kernels.build import build_lse_merge as compile_lse_merge
    from cute_kernels.runtime import aot
    import cute_kernels.runtime.compile as rc

    monkeypatch.setenv("CUTE_KERNELS_AOT_DIR", str(tmp_path))
    monkeypatch.setenv("CUTE_KERNELS_AOT_WRITE", "1")
    monkeypatch.setattr(rc, "_cache", {})
    jit = compile_lse_merge(128, torch.bfloat16).fn
    key = next(k for k in rc._cache if "lse_merge" in k)
    loaded = aot.load(key)
    assert loaded is not None
    gen = torch.Generator().manual_seed(3)
    o_part = torch.randn(4, 300, 128, generator=gen).cuda()
    lse_part = torch.randn(4, 300, generator=gen).cuda()
    offs = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
    outs = []
    for fn in (jit, loaded):
        o = torch.full((1, 300, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((1, 300), float("nan"), device="cuda")
        fn(o_part, lse_part, offs, o, lse)
        outs.append((o, lse))
    assert not outs[0][0].isnan().any()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_aot_names_follow_the_sources(tmp_path, monkeypatch):
    """The object file's name hashes the key and every source file: editing one gives another name, so a changed
    kernel never loads a stale build."""
    from cute_kernels.runtime import aot

    for pkg in ("cute_kernels", "schedulers"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "x.py").write_text("A = 1\n")
    monkeypatch.setattr(aot, "_ROOT", tmp_path)
    aot.source_hash.cache_clear()
    key = ("sm_90a", "lse_merge", 128, "torch.bfloat16")
    first = aot.entry_name(key)
    assert aot.entry_name(key) == first and aot.entry_name(key + (1,)) != first
    (tmp_path / "schedulers" / "x.py").write_text("A = 2\n")
    aot.source_hash.cache_clear()
    assert aot.entry_name(key) != first
    aot.source_hash.cache_clear()
