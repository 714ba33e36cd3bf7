"""SM90 GDN / KDA forward through the ops: input checks (CPU), smem layout views (CPU), agreement with float64 (GPU).
Every test runs on both paths of the op: the fused kernel and the two-phase path (chunk prep + state pass)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import gpu_arch, poisoned, rel_err

import cute_kernels as ck
from cute_kernels import reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
requires_sm90 = pytest.mark.skipif(gpu_arch() != "sm_90a", reason="needs an SM90 (Hopper) GPU")


@pytest.fixture(autouse=True, params=["fused", "two_phase"])
def path(request, monkeypatch):
    """Pin the op's path (CUTE_KERNELS_TWO_PHASE 0 / 1) for the test."""
    from cute_kernels.ops import linear_attention as la

    monkeypatch.setattr(la, "TWO_PHASE", "1" if request.param == "two_phase" else "0")
    return request.param


def make_inputs(B, T, H, gen, device="cpu", dtype=torch.bfloat16, K=128, V=128, kda=False, decay=1.0, g_fill=None):
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = decay * F.logsigmoid(torch.randn((B, T, H, K) if kda else (B, T, H), generator=gen)).clamp(min=-5.0)
    if g_fill is not None:
        g = torch.full_like(g, g_fill)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    cast = lambda t: t.to(dtype).to(device)
    return cast(q), cast(k), cast(v), g.to(device), cast(beta)


# ---------------------------------------------------------------- CPU: input checks


def test_bad_input():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = make_inputs(1, 8, 2, gen)
    with pytest.raises(TypeError, match="q must have dtype"):
        ck.chunk_gated_delta_rule(q.float(), k, v, g, beta)
    with pytest.raises(TypeError, match="k must have dtype"):
        ck.chunk_gated_delta_rule(q, k.half(), v, g, beta)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        ck.chunk_gated_delta_rule(q[0], k, v, g, beta)
    with pytest.raises(ValueError, match="head dims"):
        ck.chunk_gated_delta_rule(q[..., :64].contiguous(), k[..., :64].contiguous(), v, g, beta)
    with pytest.raises(ValueError, match="g must have 3 dimensions"):
        ck.chunk_gated_delta_rule(q, k, v, g[..., None].expand(1, 8, 2, 128).contiguous(), beta)
    with pytest.raises(ValueError, match="beta must have shape"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta[:, :4].contiguous())
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D int32/int64"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 7]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([1, 8]))
    q2, k2, v2, g2, b2 = make_inputs(2, 8, 2, gen)
    with pytest.raises(ValueError, match="cu_seqlens needs B == 1"):
        ck.chunk_gated_delta_rule(q2, k2, v2, g2, b2, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="initial_state must have shape"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 128, 128))
    with pytest.raises(TypeError, match="initial_state must have dtype"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 128, 128, dtype=torch.float64))
    with pytest.raises(ValueError, match="q must be contiguous"):
        ck.chunk_gated_delta_rule(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, g, beta)
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta)
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        ck.chunk_kda(q, k, v, g[..., None].expand(1, 8, 2, 128).contiguous(), beta)


LAYOUT_CHECK = r"""
import os
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
import cutlass, cutlass.cute as cute
from cute_kernels.kernels.sm90.gdn_fwd import _smem_layout

@cute.jit
def check():
    bad = 0
    for rows, cols, stages in ((64, 128, 2), (64, 64, 1), (64, 64, 2), (128, 64, 2)):
        a = _smem_layout(rows, cols, cutlass.BFloat16, stages)
        m = _smem_layout(rows, cols, cutlass.BFloat16, stages, mn_view=True)
        for s in cutlass.range_constexpr(stages):
            for r in cutlass.range_constexpr(0, rows, 3):
                for c in cutlass.range_constexpr(0, cols, 5):
                    if cutlass.const_expr(cute.crd2idx((r, c, s), a) != cute.crd2idx((c, r, s), m)):
                        bad += 1
    print("MISMATCHES", bad)

check()
"""


def test_smem_views_alias(tmp_path):
    """The K-major and MN-major views of each shared-memory buffer address the same bytes."""
    script = tmp_path / "layout_check.py"  # CuTe DSL compiles only functions defined in a file
    script.write_text(LAYOUT_CHECK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MISMATCHES 0" in proc.stdout


# ---------------------------------------------------------------- GPU: against float64


def run_and_check(B, T, H, gen, with_init, cu_seqlens=None, dtype=torch.bfloat16, kda=False, decay=1.0, g_fill=None):
    dev = torch.device("cuda")
    q, k, v, g, beta = make_inputs(B, T, H, gen, dev, dtype, kda=kda, decay=decay, g_fill=g_fill)
    op = ck.chunk_kda if kda else ck.chunk_gated_delta_rule
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    init = torch.randn(N, H, 128, 128, generator=gen).to(dev) * 0.1 if with_init else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32, device=dev)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                                   cu_seqlens=cu)
    outs = []
    for _ in range(2):
        out = (poisoned((B, T, H, 128), dtype, dev), poisoned((N, H, 128, 128), torch.float32, dev))
        o, s = op(q, k, v, g, beta, initial_state=init, output_final_state=True, cu_seqlens=cu, out=out)
        assert not o.isnan().any() and not s.isnan().any()
        outs.append((o, s))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), "run-to-run difference"
    o, s = outs[0]
    assert rel_err(o, want_o) <= 5e-3, rel_err(o, want_o)
    assert rel_err(s, want_s) <= 5e-3, rel_err(s, want_s)
    return q, k, v, g, beta, init, o, s


@requires_sm90
@pytest.mark.parametrize("T", [1, 64, 100, 1000, 4096])
@pytest.mark.parametrize("B,H", [(1, 1), (3, 4), (1, 16)])
@pytest.mark.parametrize("with_init", [False, True])
def test_gdn_matches_reference(B, T, H, with_init):
    gen = torch.Generator().manual_seed(T * 100 + B * 10 + H + with_init)
    run_and_check(B, T, H, gen, with_init)


@requires_sm90
@pytest.mark.parametrize("with_init", [False, True])
def test_gdn_varlen(with_init):
    gen = torch.Generator().manual_seed(11)
    cu = [0, 1, 65, 65, 1000, 1063, 3000]
    run_and_check(1, cu[-1], 4, gen, with_init, cu_seqlens=cu)


@requires_sm90
def test_gdn_fp16():
    run_and_check(2, 300, 2, torch.Generator().manual_seed(5), True, dtype=torch.float16)


@requires_sm90
def test_gdn_against_fla():
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    gen = torch.Generator().manual_seed(9)
    q, k, v, g, beta, init, o, s = run_and_check(2, 1000, 4, gen, True)
    o_fla, s_fla = fla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init, output_final_state=True)
    assert rel_err(o, o_fla) <= 1e-2 and rel_err(s, s_fla) <= 1e-2


@requires_sm90
@pytest.mark.parametrize("T", [1, 64, 100, 1000])
@pytest.mark.parametrize("with_init", [False, True])
def test_kda_matches_reference(T, with_init):
    run_and_check(2, T, 3, torch.Generator().manual_seed(T + 7 * with_init), with_init, kda=True)


@requires_sm90
def test_kda_varlen_and_strong_decay():
    """Varlen, and decays far past FLA's lower bound (up to -20 per step and channel): still finite and right."""
    run_and_check(1, 3000, 2, torch.Generator().manual_seed(3), True, cu_seqlens=[0, 1, 65, 65, 1000, 3000], kda=True)
    run_and_check(1, 500, 2, torch.Generator().manual_seed(4), False, kda=True, decay=4.0)


@requires_sm90
@pytest.mark.parametrize("g_fill", [-5.0, -5.3, -8.0])
def test_kda_anchor_paths(g_fill):
    """Constant decays on both sides of the anchored path's limit (2^112 per 16 rows = -5.18 per step): FLA's
    lower bound -5 takes the fast anchored products, -5.3 and -8 the exact diagonal path; all must be right."""
    run_and_check(1, 300, 2, torch.Generator().manual_seed(6), True, kda=True, g_fill=g_fill)


@requires_sm90
def test_kda_against_fla():
    fla = pytest.importorskip("fla.ops.kda")
    gen = torch.Generator().manual_seed(19)
    q, k, v, g, beta, init, o, s = run_and_check(2, 1000, 4, gen, True, kda=True)
    o_fla, s_fla = fla.chunk_kda(q, k, v, g, beta, initial_state=init, output_final_state=True)
    assert rel_err(o, o_fla) <= 1e-2 and rel_err(s, s_fla) <= 1e-2
