"""Every kernel variant compiles on this (GPU-less) machine for sm_90a, sm_100a and sm_103a, with the PTX it needs.

Each arch runs in its own process: CuTe DSL reads CUTE_DSL_ARCH when cutlass is first imported.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", params=["sm_90a", "sm_100a", "sm_103a"])
def compiled_dir(request, tmp_path_factory):
    arch = request.param
    out = tmp_path_factory.mktemp(arch)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.pop("CUTE_DSL_ARCH", None)
    proc = subprocess.run([sys.executable, "-m", "cute_kernels", "compile", "--arch", arch, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return arch, out, proc.stdout


def variant_names(arch):
    code = f"from cute_kernels.variants import all_variants; print('\\n'.join(v.name for v in all_variants('{arch}')))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), CUTE_DSL_ARCH=arch)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_every_variant_written(compiled_dir):
    arch, out, stdout = compiled_dir
    names = variant_names(arch)
    assert len(names) >= 9
    for name in names:
        for ext in ("ptx", "cubin"):
            path = out / f"{name}.{arch}.{ext}"
            assert path.is_file() and path.stat().st_size > 0, f"{path} missing or empty"
        assert f"{name} " in stdout
    assert "0 failed" in stdout


def test_no_spills_on_sm100(compiled_dir):
    """Every SM100 build: cuobjdump (the test extra's wheel) reads 0 stack and 0 local bytes from its cubin."""
    arch, _, stdout = compiled_dir
    if arch == "sm_90a":
        pytest.skip("sm_90a builds report their spills; the no-spill rule is the SM100 builds'")
    rows = [line.split() for line in stdout.splitlines() if f" {arch} " in line]
    assert rows and all(r[3] == "0/0" for r in rows), [r[:4] for r in rows if r[3] != "0/0"]


def test_ptx_contents(compiled_dir):
    arch, out, _ = compiled_dir
    ptx = (out / f"affine_merge_prefetch_k128_v128_init.{arch}.ptx").read_text()
    assert f".target {arch}" in ptx
    assert "ld.global.v4" in ptx or "ld.global.v2.b64" in ptx  # 16-byte loads of M rows (v2.b64 on SM100)
    assert "bar.sync" in ptx
    ptx = (out / f"lse_merge_d128_bfloat16.{arch}.ptx").read_text()
    assert "ld.global.v4" in ptx and "ex2.approx" in ptx
    cubin = (out / f"lse_merge_d128_bfloat16.{arch}.cubin").read_bytes()
    assert cubin[:4] == b"\x7fELF"
    if arch == "sm_90a":  # the fused GDN forward: TMA loads, wgmma products, register reallocation
        ptx = (out / f"gdn_fused_forward_init_final_bfloat16_beta_bfloat16.{arch}.ptx").read_text()
        for needle in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg.inc", "setmaxnreg.dec"):
            assert needle in ptx, needle
    # split-KV decode: TMA boxes and the fixup's one counter add, thread 0's gpu-scope acq_rel atomic (release
    # before the count, acquire after it) and no fence: the other threads are ordered by the CTA barriers around it
    ptx = (out / f"decode_g8_q1_bfloat16.{arch}.ptx").read_text()
    assert "cp.async.bulk.tensor" in ptx and ptx.count("atom.global.acq_rel.add") == 1
    assert "fence.acq_rel.gpu" not in ptx and "atom.global.add" not in ptx
    assert "griddepcontrol.wait" in ptx   # launched early (PDL): waits before any global access
    if arch == "sm_90a":   # an even split of a contiguous cache: the first K / V block before the length's load
        after_wait = ptx[ptx.index("griddepcontrol.wait"):]
        assert after_wait.index("cp.async.bulk.tensor") < after_wait.index("ld.global")
    # the decode steps, launched early (PDL): the wait comes before the first global load (the pool slot the
    # previous step may still be writing)
    for name in ("recurrent_gdn_gva2_pool_l2norm_gate_tokens4", "recurrent_gdn_gva2_pool_l2norm_gate_tokens8_tensor_cores"):
        ptx = (out / f"{name}.{arch}.ptx").read_text()
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, name
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global"), name


def test_cli_rejects_unknown_op(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "cute_kernels", "compile", "--arch", "sm_90a", "--op", "nope",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "no variant" in proc.stderr
