"""SM90 GDN / KDA forward through the ops: input checks (CPU), smem layout views (CPU), agreement with float64 (GPU).
Every test runs on both paths of the op: the fused kernel and the two-phase path (chunk prep + state pass)."""

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import import_peer, poisoned, rel_err, requires_sm90
from inputs import GATE_REGIMES, initial_state, make_inputs

import cute_kernels as ck
import cute_kernels.ops.linear_attention as la
from cute_kernels import reference as ref
from cute_kernels.plan import PlanOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(params=["fused", "two_phase"])
def path(request, monkeypatch):
    """The op's path for the test (`PlanOptions`): every GPU test runs on both; outputs and summaries the runners
    allocate start as NaN."""
    from cute_kernels.paths.fused import FusedRun
    from cute_kernels.paths.two_phase import OverlapRun, PrepRun, StateRun

    for cls in (FusedRun, PrepRun, StateRun, OverlapRun):
        monkeypatch.setattr(cls, "poison", True)
    return PlanOptions(path=request.param)


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
    with pytest.raises(ValueError, match=r"v's heads \(HV = 3\) must be a multiple"):
        ck.chunk_gated_delta_rule(q, k, torch.randn(1, 8, 3, 128, dtype=q.dtype), g, beta)
    with pytest.raises(ValueError, match="g must have shape"):   # GVA: g per value head
        ck.chunk_gated_delta_rule(q, k, torch.randn(1, 8, 4, 128, dtype=q.dtype), g, beta)
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



def test_requires_grad_raises_naming_the_input():
    """The ops are forward-only: an input that requires grad under grad mode raises (its gradient would be lost);
    under no_grad the call goes on to the next check (here: CPU tensors)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = make_inputs(1, 8, 2, gen)
    with pytest.raises(RuntimeError, match="chunk_gated_delta_rule is forward-only, but v requires grad"):
        ck.chunk_gated_delta_rule(q, k, v.requires_grad_(), g, beta)
    with pytest.raises(RuntimeError, match="chunk_kda is forward-only, but g requires grad"):
        ck.chunk_kda(q, k, v.detach(), g[..., None].expand(1, 8, 2, 128).contiguous().requires_grad_(), beta)
    with torch.no_grad(), pytest.raises(ValueError, match="must be on a CUDA device"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta)
    with pytest.raises(RuntimeError, match="decode_attention is forward-only, but q requires grad"):
        ck.decode_attention(torch.randn(1, 8, 128, requires_grad=True), torch.randn(1, 16, 2, 128),
                            torch.randn(1, 16, 2, 128), torch.tensor([16], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="affine_merge is forward-only, but M requires grad"):
        ck.affine_merge(torch.zeros(2, 1, 128, 128, requires_grad=True), torch.zeros(2, 1, 128, 128), [0, 2])


LAYOUT_CHECK = r"""
import os
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
import cutlass, cutlass.cute as cute
from cute_kernels.kernels.sm90.wgmma_tiles import smem_layout as _smem_layout

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


def run_and_check(path, B, T, H, gen, with_init, cu_seqlens=None, dtype=torch.bfloat16, kda=False,
                  regime="strong", scale=None, beta_dtype=None, final=True, l2norm=False, g_scale=1.0, g_fill=None):
    """One op call on `path` (PlanOptions) against the float64 reference: outputs NaN-poisoned before each of two
    runs, which must be bitwise equal; o and the final state within 5e-3 (rel. RMS). `final=False`:
    output_final_state=False (the final state is neither stored nor returned); `l2norm`: raw q, k with
    use_qk_l2norm_in_kernel=True."""
    dev = torch.device("cuda")
    q, k, v, g, beta = make_inputs(B, T, H, gen, dev, dtype, kda=kda, regime=regime, beta_dtype=beta_dtype,
                                   normalize=not l2norm)
    g = torch.full_like(g, g_fill) if g_fill is not None else g * g_scale
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    init = initial_state(N, H, gen, dev) if with_init else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32, device=dev)
    qn, kn = ((F.normalize(x.float(), dim=-1).to(dtype) for x in (q, k)) if l2norm else (q, k))
    want_o, want_s = ref.chunk_gated_delta_rule_ref(qn, kn, v, g, beta, scale=scale, initial_state=init,
                                                   output_final_state=True, cu_seqlens=cu)
    outs = []
    for _ in range(2):
        out = (poisoned((B, T, H, 128), dtype, dev), poisoned((N, H, 128, 128), torch.float32, dev) if final else None)
        o, s = la.forward(q, k, v, g, beta, scale, init, final, cu, l2norm, None, out, kda=kda, options=path)
        assert o is out[0] and not o.isnan().any()
        if final:
            assert s is out[1] and not s.isnan().any()
        else:
            assert s is None
        outs.append((o, s))
    assert torch.equal(outs[0][0], outs[1][0]), "run-to-run difference (o)"
    o, s = outs[0]
    assert rel_err(o, want_o) <= 5e-3, rel_err(o, want_o)
    if final:
        assert torch.equal(outs[0][1], outs[1][1]), "run-to-run difference (final state)"
        assert rel_err(s, want_s) <= 5e-3, rel_err(s, want_s)
    return q, k, v, g, beta, init, o, s


@requires_sm90
@pytest.mark.parametrize("T", [1, 64, 100, 1000, 4096])
@pytest.mark.parametrize("B,H", [(1, 1), (3, 4), (1, 16)])
@pytest.mark.parametrize("with_init", [False, True])
def test_gdn_matches_reference(B, T, H, with_init, path):
    gen = torch.Generator().manual_seed(T * 100 + B * 10 + H + with_init)
    run_and_check(path, B, T, H, gen, with_init)


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("regime", GATE_REGIMES)
@pytest.mark.parametrize("with_init", [False, True])
def test_long_sequence_in_every_gate_regime(kda, regime, with_init, path):
    """A long sequence (T = 4100: not a multiple of 64) in every gate regime, through the path's default plan
    (segments by the cost model): with weak or zero decay the state carried across chunks and segments is most
    of the output, so a wrong carry, summary or merge shows."""
    gen = torch.Generator().manual_seed(41 + 2 * kda + 4 * with_init + 8 * GATE_REGIMES.index(regime))
    run_and_check(path, 1, 4100, 4, gen, with_init, kda=kda, regime=regime)


# one very long sequence among many short ones (3 to 75 tokens, one empty)
LONG_AND_SHORT = list(itertools.accumulate([0, 4500] + [3 * n for n in range(1, 4)] + [0]
                                           + [3 * n for n in range(4, 26)]))


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("regime", GATE_REGIMES)
@pytest.mark.parametrize("cu", [[0, 1, 65, 65, 1000, 1063, 3000], LONG_AND_SHORT], ids=["mixed", "long-and-short"])
@pytest.mark.parametrize("with_init", [False, True])
def test_varlen(kda, regime, cu, with_init, path):
    gen = torch.Generator().manual_seed(11 + kda + 2 * GATE_REGIMES.index(regime) + 16 * len(cu) + with_init)
    run_and_check(path, 1, cu[-1], 4 if len(cu) < 10 else 2, gen, with_init, cu_seqlens=cu, kda=kda, regime=regime)


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("dtype,beta_dtype", [(torch.float16, None), (torch.float16, torch.float32),
                                              (torch.bfloat16, torch.float32)], ids=["fp16", "fp16-beta32", "beta32"])
def test_dtypes(kda, dtype, beta_dtype, path):
    """fp16 inputs (GDN and KDA), and beta in fp32 beside 16-bit q, k, v."""
    gen = torch.Generator().manual_seed(5 + kda + (beta_dtype is not None) * 2 + (dtype == torch.float16) * 4)
    run_and_check(path, 2, 300, 2, gen, True, dtype=dtype, beta_dtype=beta_dtype, kda=kda, regime="weak")


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("T", [300, 4100])
def test_scale_final_state_and_l2norm(kda, T, path):
    """A non-default scale; output_final_state=False (T = 300: one launch or segment; 4100: the segmented
    plans); use_qk_l2norm_in_kernel=True on raw q, k."""
    gen = torch.Generator().manual_seed(77 + kda + T)
    run_and_check(path, 1, T, 4, gen, True, kda=kda, regime="weak", scale=0.3)
    run_and_check(path, 1, T, 4, gen, True, kda=kda, regime="weak", final=False)
    run_and_check(path, 1, T, 4, gen, False, kda=kda, regime="mixed", l2norm=True)


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("T,cu", [(1000, None), (4100, None), (3000, [0, 1, 65, 65, 1000, 1063, 3000])],
                         ids=["1000", "4100", "varlen"])
def test_gva(kda, group, T, cu, path):
    """GVA: v, g, beta and the states have HV = group x H heads, q and k H; value head hv reads q / k head
    hv // group. Against the reference with q / k repeated per group (weak decay: the carried state shows)."""
    gen = torch.Generator().manual_seed(23 + group + 2 * kda + T)
    dev = torch.device("cuda")
    B = 2 if cu is None else 1
    H, HV = 2, 2 * group
    _, _, v, g, beta = make_inputs(B, T, HV, gen, dev, kda=kda, regime="weak")
    q, k, _, _, _ = make_inputs(B, T, H, gen, dev)
    N = B if cu is None else len(cu) - 1
    init = initial_state(N, HV, gen, dev)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    rep = lambda x: x.repeat_interleave(group, dim=2)   # noqa: E731
    want_o, want_s = ref.chunk_gated_delta_rule_ref(rep(q), rep(k), v, g, beta, initial_state=init,
                                                   output_final_state=True, cu_seqlens=cu_t)
    outs = []
    for _ in range(2):
        out = (poisoned((B, T, HV, 128), q.dtype, dev), poisoned((N, HV, 128, 128), torch.float32, dev))
        o, s = la.forward(q, k, v, g, beta, None, init, True, cu_t, False, None, out, kda=kda, options=path)
        assert not o.isnan().any() and not s.isnan().any()
        outs.append((o.clone(), s.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert rel_err(outs[0][0], want_o) <= 5e-3, rel_err(outs[0][0], want_o)
    assert rel_err(outs[0][1], want_s) <= 5e-3, rel_err(outs[0][1], want_s)


def test_gate_arguments_errors_and_fla_order():
    """FLA's gate arguments: errors name the argument; the positional order is FLA 0.6's (use_qk_l2norm_in_kernel
    right after output_final_state)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = make_inputs(1, 8, 2, gen)
    with pytest.raises(ValueError, match="A_log must be given"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="A_log must have HV = 2"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True, A_log=torch.zeros(3))
    with pytest.raises(ValueError, match="dt_bias must have 256 elements"):
        ck.chunk_kda(q, k, v, g[..., None].expand(1, 8, 2, 128).contiguous(), beta, use_gate_in_kernel=True,
                     A_log=torch.zeros(2), dt_bias=torch.zeros(2))
    with pytest.raises(ValueError, match="allow_neg_eigval=True requires"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(NotImplementedError, match="state_v_first"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta, state_v_first=True)
    with pytest.raises(ValueError, match="use_graph=True needs cu_seqlens on the GPU"):
        ck.chunk_kda(q, k, v, g[..., None].expand(1, 8, 2, 128).contiguous(), beta, use_graph=True,
                     cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="return_intermediate_states"):
        ck.chunk_kda(q, k, v, g[..., None].expand(1, 8, 2, 128).contiguous(), beta,
                     return_intermediate_states=True)
    import inspect
    fla_order = ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                 "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first",
                 "cu_seqlens"]
    assert list(inspect.signature(ck.chunk_gated_delta_rule).parameters)[:len(fla_order)] == fla_order


def test_gate_arguments_match_the_spec():
    """The gate forms the ops apply before the kernels equal the decode step's float64 spec (FLA's formulas)."""
    from cute_kernels.reference.recurrent_step import gate_values

    gen = torch.Generator().manual_seed(1)
    g = torch.randn(2, 5, 3, 128, generator=gen)
    beta = torch.randn(2, 5, 3, generator=gen)
    A, bias = torch.randn(3, generator=gen), torch.randn(3 * 128, generator=gen)
    for kda, lb in [(False, None), (True, None), (True, -5.0)]:
        gk = g if kda else g[..., 0].contiguous()
        b = bias if kda else bias[:3]
        got_g, got_b = la.gate_inputs(gk, beta, kda, True, A, b, lb, True, True)
        want = gate_values(gk.double(), kda, A.double(), b.double(), lb)
        assert torch.allclose(got_g.double(), want, rtol=1e-5, atol=1e-6)
        assert torch.allclose(got_b, 2 * torch.sigmoid(beta))
    same_g, same_b = la.gate_inputs(g, beta, True, False, None, None, None, False, False)
    assert same_g is g and same_b is beta


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("form", ["gate", "gate_beta_neg", "lower_bound"])
def test_gate_arguments_against_fla(kda, form, path):
    """use_gate_in_kernel (A_log, dt_bias; KDA's lower_bound), use_beta_sigmoid_in_kernel and allow_neg_eigval,
    applied before the kernels (the torch.compile path) and in each path's kernels: against the float64 reference
    on the transformed gates, and against FLA with the same flags."""
    if form == "lower_bound" and not kda:
        pytest.skip("lower_bound is KDA's")
    fla = import_peer("fla.ops.kda" if kda else "fla.ops.gated_delta_rule")
    gen = torch.Generator().manual_seed(31 + kda)
    dev = torch.device("cuda")
    q, k, v, _, beta = make_inputs(2, 1000, 4, gen, dev, kda=kda)
    g_raw = torch.randn((2, 1000, 4, 128) if kda else (2, 1000, 4), generator=gen).to(dev)
    A_log = (torch.rand(4, generator=gen) * 2 - 3).to(dev)
    dt_bias = (0.5 * torch.randn((4, 128) if kda else (4,), generator=gen)).to(dev)
    kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    if form == "gate_beta_neg":
        beta = torch.randn(2, 1000, 4, generator=gen).to(dev, q.dtype)
        kw.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    if form == "lower_bound":
        kw.update(lower_bound=-5.0)
    init = initial_state(2, 4, gen, dev)
    op = ck.chunk_kda if kda else ck.chunk_gated_delta_rule
    g_log, b_used = la.gate_inputs(g_raw, beta, kda, True, A_log, dt_bias, kw.get("lower_bound"),
                                   kw.get("use_beta_sigmoid_in_kernel", False), kw.get("allow_neg_eigval", False))
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g_log, b_used, initial_state=init,
                                                   output_final_state=True)
    o, s = la.forward(q, k, v, g_log, b_used, None, init, True, None, False, None, None, kda=kda, options=path)
    gate = la.gate_arguments(g_raw, beta, kda, True, A_log, dt_bias, kw.get("lower_bound"),
                             kw.get("use_beta_sigmoid_in_kernel", False), kw.get("allow_neg_eigval", False))
    o3, s3 = la.forward(q, k, v, g_raw, beta, None, init, True, None, False, None, None, kda=kda, options=path,
                        gate=gate)   # the gate arguments applied in this path's kernels
    o2, s2 = op(q, k, v, g_raw, beta, initial_state=init, output_final_state=True, **kw)
    assert rel_err(o, want_o) <= 5e-3 and rel_err(s, want_s) <= 5e-3
    assert rel_err(o3, want_o) <= 5e-3 and rel_err(s3, want_s) <= 5e-3
    assert rel_err(o2, want_o) <= 5e-3 and rel_err(s2, want_s) <= 5e-3   # the public call (the planner's path)
    fla_op = fla.chunk_kda if kda else fla.chunk_gated_delta_rule
    o_fla, s_fla = fla_op(q, k, v, g_raw, beta, initial_state=init, output_final_state=True, **kw)
    assert rel_err(o, o_fla) <= 1e-2 and rel_err(s, s_fla) <= 1e-2


def test_state_pool_errors():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = make_inputs(2, 8, 2, gen)
    idx = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="initial_state must be the state pool"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta, initial_state_indices=idx)
    with pytest.raises(ValueError, match=r"the pool\) must be \[P, HV = 2"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(5, 3, 128, 128),
                                  initial_state_indices=idx)
    with pytest.raises(ValueError, match=r"final_state_indices must be \[N = 2\]"):
        ck.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(5, 2, 128, 128),
                                  final_state_indices=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="initial_state_indices must have dtype"):
        ck.chunk_kda(q, k, v, g[..., None].expand(2, 8, 2, 128).contiguous(), beta,
                     initial_state=torch.zeros(5, 2, 128, 128), initial_state_indices=idx.long())


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("T,cu", [(300, None), (4100, None), (3000, [0, 1, 65, 65, 1000, 1063, 3000])],
                         ids=["300", "4100", "varlen"])
def test_state_pool_in_place(kda, T, cu, path):
    """Start states from pool slots (one slot shared by two sequences, one -1: zeros), final states written in
    place to other slots (one -1: not written); every other slot untouched."""
    gen = torch.Generator().manual_seed(61 + kda + T)
    dev = torch.device("cuda")
    B = 3 if cu is None else 1
    N = B if cu is None else len(cu) - 1
    q, k, v, g, beta = make_inputs(B, T, 2, gen, dev, kda=kda, regime="weak")
    pool = initial_state(2 * N + 2, 2, gen, dev)
    init_idx = torch.tensor(([1, 1] + [-1] + list(range(3, N)))[:N], dtype=torch.int32, device=dev)
    final_idx = torch.tensor(([N + 2, -1] + list(range(N + 3, 2 * N + 1)))[:N], dtype=torch.int32, device=dev)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    start = torch.stack([pool[i] if i >= 0 else torch.zeros_like(pool[0]) for i in init_idx.tolist()])
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=start, output_final_state=True,
                                                   cu_seqlens=cu_t)
    mine = pool.clone()
    o, returned = la.pooled_forward(q, k, v, g, beta, None, mine, True, cu_t, False, None, None, init_idx, final_idx,
                                    kda=kda)
    assert returned is mine
    assert rel_err(o, want_o) <= 5e-3
    written = {s: n for n, s in enumerate(final_idx.tolist()) if s >= 0}
    for slot in range(pool.shape[0]):
        if slot in written:
            assert rel_err(mine[slot], want_s[written[slot]]) <= 5e-3
        else:
            assert torch.equal(mine[slot], pool[slot]), slot


@requires_sm90
def test_state_pool_graph_replay_with_new_slots():
    """Captured once, replayed with new slot indices: the indices are read on the device only."""
    gen = torch.Generator().manual_seed(5)
    dev = torch.device("cuda")
    q, k, v, g, beta = make_inputs(2, 256, 2, gen, dev, regime="weak")
    pool = initial_state(6, 2, gen, dev)
    idx_in = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    idx_out = torch.tensor([2, 3], dtype=torch.int32, device=dev)
    o = torch.empty_like(v)
    call = lambda: ck.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, output_final_state=True,  # noqa
                                             initial_state_indices=idx_in, final_state_indices=idx_out,
                                             out=(o, None))
    call()
    saved = pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for ins, outs in [((4, -1), (0, 5)), ((3, 3), (1, 2))]:
        pool.copy_(saved)
        idx_in.copy_(torch.tensor(ins, dtype=torch.int32))
        idx_out.copy_(torch.tensor(outs, dtype=torch.int32))
        start = torch.stack([saved[i] if i >= 0 else torch.zeros_like(saved[0]) for i in ins])
        want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=start,
                                                       output_final_state=True)
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(o, want_o) <= 5e-3
        for n, slot in enumerate(outs):
            assert rel_err(pool[slot], want_s[n]) <= 5e-3


def test_device_table_matches_the_sequence_scheduler():
    """The graph mode's tile table, built with torch ops from cu_seqlens, is SequenceScheduler's (CPU)."""
    from schedulers import Problem, SequenceScheduler
    from schedulers.host import sequence_table_on_device

    cu = [0, 1, 65, 65, 1000, 1063, 3000, 3000]
    want = SequenceScheduler().schedule(Problem.varlen(cu, 3)).table()
    got = sequence_table_on_device(torch.tensor(cu), 3)
    assert got.dtype == torch.int32 and torch.equal(got, want)


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_graph_varlen_replays_with_new_lengths(kda):
    """use_graph=True: captured once with some lengths, replayed with others (cu_seqlens padded to max_num_seqs + 1
    with zero-length sequences); each replay against the reference. Also the eager call, and GVA."""
    gen = torch.Generator().manual_seed(71 + kda)
    dev = torch.device("cuda")
    T, S = 2000, 5
    _, _, v, g, beta = make_inputs(1, T, 4, gen, dev, kda=kda, regime="weak")
    q, k, _, _, _ = make_inputs(1, T, 2, gen, dev)
    init = initial_state(S, 4, gen, dev)
    cu = torch.tensor([0, 700, 700, 1500, 2000, 2000], dtype=torch.int32, device=dev)
    o = torch.empty_like(v)
    final = torch.empty(S, 4, 128, 128, device=dev)
    op = ck.chunk_kda if kda else ck.chunk_gated_delta_rule
    call = lambda: op(q, k, v, g, beta, initial_state=init, output_final_state=True, cu_seqlens=cu,  # noqa: E731
                      use_graph=True, max_num_seqs=S, out=(o, final))
    rep = lambda x: x.repeat_interleave(2, dim=2)   # noqa: E731

    def check(offsets):
        cu_ref = torch.tensor(offsets, dtype=torch.int32, device=dev)
        want_o, want_s = ref.chunk_gated_delta_rule_ref(rep(q), rep(k), v, g, beta, initial_state=init,
                                                       output_final_state=True, cu_seqlens=cu_ref)
        assert rel_err(o, want_o) <= 5e-3 and rel_err(final, want_s) <= 5e-3

    call()
    check(cu.tolist())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for offsets in ([0, 64, 100, 1999, 2000, 2000], [0, 2000, 2000, 2000, 2000, 2000], [0, 1, 2, 3, 4, 2000]):
        cu.copy_(torch.tensor(offsets, dtype=torch.int32))
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(offsets)


@requires_sm90
def test_gdn_against_fla(path):
    fla = import_peer("fla.ops.gated_delta_rule")
    gen = torch.Generator().manual_seed(9)
    q, k, v, g, beta, init, o, s = run_and_check(path, 2, 1000, 4, gen, True)
    o_fla, s_fla = fla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init, output_final_state=True)
    assert rel_err(o, o_fla) <= 1e-2 and rel_err(s, s_fla) <= 1e-2


@requires_sm90
@pytest.mark.parametrize("T", [1, 64, 100, 1000])
@pytest.mark.parametrize("with_init", [False, True])
def test_kda_matches_reference(T, with_init, path):
    run_and_check(path, 2, T, 3, torch.Generator().manual_seed(T + 7 * with_init), with_init, kda=True)


@requires_sm90
def test_kda_strong_decay(path):
    """Decays far past FLA's lower bound (up to -20 per step and channel): still finite and right."""
    run_and_check(path, 1, 500, 2, torch.Generator().manual_seed(4), False, kda=True, g_scale=4.0)


@requires_sm90
@pytest.mark.parametrize("g_fill", [-5.0, -5.3, -8.0])
def test_kda_anchor_paths(g_fill, path):
    """Constant decays on both sides of the anchored path's limit (2^112 per 16 rows = -5.18 per step): FLA's
    lower bound -5 takes the fast anchored products, -5.3 and -8 the exact diagonal path; all must be right."""
    run_and_check(path, 1, 300, 2, torch.Generator().manual_seed(6), True, kda=True, g_fill=g_fill)


@requires_sm90
def test_kda_against_fla(path):
    fla = import_peer("fla.ops.kda")
    gen = torch.Generator().manual_seed(19)
    q, k, v, g, beta, init, o, s = run_and_check(path, 2, 1000, 4, gen, True, kda=True)
    o_fla, s_fla = fla.chunk_kda(q, k, v, g, beta, initial_state=init, output_final_state=True)
    assert rel_err(o, o_fla) <= 1e-2 and rel_err(s, s_fla) <= 1e-2


@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_qk_l2norm_kernel(dtype):
    """`QKL2Norm` (use_qk_l2norm_in_kernel): every row of q and k over sqrt(sum of squares + 1e-6) against float64,
    on rows of norm ~1 (where eps or a partial sum shows), a zero row and a large one; outputs poisoned first; two
    runs bitwise equal."""
    from cute_kernels.kernels.build import build_qk_l2norm

    gen = torch.Generator().manual_seed(5)
    q = (0.09 * torch.randn(2, 333, 3, 128, generator=gen)).to("cuda", dtype)
    k = (0.09 * torch.randn(2, 333, 3, 128, generator=gen)).to("cuda", dtype)
    q[0, 0, 0] = 0
    k[1, 5, 2] *= 300
    fn = build_qk_l2norm(dtype).fn
    outs = []
    for _ in range(2):
        qn, kn = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
        fn(q, k, qn, kn)
        outs.append((qn, kn))
    for x, y in zip((q, k), outs[0]):
        xd = x.double()
        want = xd / torch.sqrt((xd * xd).sum(-1, keepdim=True) + 1e-6)
        assert not torch.isnan(y).any()
        assert (y.double() - want).abs().max().item() <= 2 ** -7   # one 16-bit rounding of a value <= 1
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
    assert outs[0][0][0, 0, 0].abs().max().item() == 0
