"""The decode step (`fused_recurrent_gated_delta_rule`, `fused_recurrent_kda`): the float64 spec against the
definition (CPU), argument checks and the custom op's fake (CPU), the kernel against the spec and FLA (GPU)."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import cute_kernels as ck
from cute_kernels.ops import recurrent as recurrent_op
from cute_kernels.reference import recurrent_gated_delta_rule
from cute_kernels.reference.recurrent_step import fused_recurrent_ref, gate_values
from tests.conftest import import_peer, rel_err

D = 128


def make(B, T, H, HV, kda, device="cpu", dtype=torch.bfloat16, decay="weak", seed=0, raw_gates=False):
    """Decode-step inputs. decay: 'weak' (log decay about -0.01 per step: the carried state matters), 'zero' or
    'strong'. raw_gates: g, beta as pre-activation values (the gate-in-kernel and beta-sigmoid forms)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    q = F.normalize(r(B, T, H, D), dim=-1).to(dtype)
    k = F.normalize(r(B, T, H, D), dim=-1).to(dtype)
    v = r(B, T, HV, D).to(dtype)
    gshape = (B, T, HV, D) if kda else (B, T, HV)
    if raw_gates:
        g = r(*gshape)
        beta = r(B, T, HV).to(dtype)
    else:
        g = {"weak": -0.01 * torch.rand(*gshape, generator=gen), "zero": torch.zeros(gshape),
             "strong": F.logsigmoid(r(*gshape))}[decay]
        beta = torch.sigmoid(r(B, T, HV)).to(dtype)
    return [x.to(device) for x in (q, k, v, g, beta)]


# ----------------------------------------------------------------------------------------- the spec (CPU)

@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_spec_matches_the_definition(kda, varlen):
    q, k, v, g, beta = make(2, 7, 2, 2, kda, decay="weak")
    cu = None
    if varlen:
        q, k, v, g, beta = (x.reshape(1, 14, *x.shape[2:]) for x in (q, k, v, g, beta))
        cu = torch.tensor([0, 3, 3, 14])
    N = 3 if varlen else 2
    s0 = torch.randn(N, 2, D, D, dtype=torch.float64)
    o, final = fused_recurrent_ref(q, k, v, g, beta, kda=kda, scale=0.3, initial_state=s0, output_final_state=True,
                                   cu_seqlens=cu)
    o_def, final_def = recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=s0,
                                                  output_final_state=True, cu_seqlens=cu)
    assert torch.allclose(o, o_def, rtol=1e-10, atol=1e-10)
    assert torch.allclose(final, final_def, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kda", [False, True])
def test_spec_gva_reads_q_and_k_of_the_group(kda):
    q, k, v, g, beta = make(1, 5, 2, 4, kda)
    o, final = fused_recurrent_ref(q, k, v, g, beta, kda=kda, output_final_state=True)
    rep = lambda x: x.repeat_interleave(2, dim=2)   # noqa: E731
    o_def, final_def = recurrent_gated_delta_rule(rep(q), rep(k), v, g, beta, output_final_state=True)
    assert torch.allclose(o, o_def, atol=1e-12) and torch.allclose(final, final_def, atol=1e-12)
    # value heads 0-1 read q/k head 0, value heads 2-3 head 1: changing q's head 1 changes heads 2-3 only
    q2 = q.clone()
    q2[:, :, 1] = q2[:, :, 1].flip(-1)
    o2, _ = fused_recurrent_ref(q2, k, v, g, beta, kda=kda)
    assert torch.equal(o2[:, :, :2], o[:, :, :2])
    assert not torch.allclose(o2[:, :, 2:], o[:, :, 2:])


def test_spec_gate_forms():
    g = torch.randn(3, 4, dtype=torch.float64)
    A, b = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    want = -torch.exp(A) * torch.log1p(torch.exp(g + b))
    assert torch.allclose(gate_values(g, False, A, b), want)
    gk = torch.randn(3, 4, D, dtype=torch.float64)
    bk = torch.randn(4 * D, dtype=torch.float64)
    want = -5.0 * torch.sigmoid(torch.exp(A)[:, None] * (gk + bk.view(4, D)))
    assert torch.allclose(gate_values(gk, True, A, bk, lower_bound=-5.0), want)
    assert torch.allclose(gate_values(gk, True, None, None, lower_bound=-5.0), -5.0 * torch.sigmoid(gk))


def test_spec_pool_and_speculative_writes():
    q, k, v, g, beta = make(3, 4, 1, 1, False)
    pool = torch.randn(6, 1, D, D, dtype=torch.float64)
    init = torch.tensor([2, 2, -1], dtype=torch.int32)        # two sequences from one slot, one from zeros
    fin = torch.tensor([0, -1, 5], dtype=torch.int32)         # one final not written
    o, new_pool = fused_recurrent_ref(q, k, v, g, beta, kda=False, initial_state=pool, output_final_state=True,
                                      initial_state_indices=init, final_state_indices=fin)
    dense = torch.stack([pool[2], pool[2], torch.zeros_like(pool[0])])
    o_def, final_def = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=dense, output_final_state=True)
    assert torch.allclose(o, o_def, atol=1e-12)
    assert torch.allclose(new_pool[0], final_def[0]) and torch.allclose(new_pool[5], final_def[2])
    for untouched in (1, 2, 3, 4):
        assert torch.equal(new_pool[untouched], pool[untouched])
    # speculative: start at [n, accepted - 1], the state after token t at [n, t]
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    acc = torch.tensor([2, 1, 3], dtype=torch.int32)
    o_s, pool_s = fused_recurrent_ref(q, k, v, g, beta, kda=False, initial_state=pool, output_final_state=True,
                                      initial_state_indices=idx, final_state_indices=idx, num_accepted_tokens=acc)
    dense = torch.stack([pool[1], pool[4], torch.zeros_like(pool[0])])
    o_def, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=dense)
    assert torch.allclose(o_s, o_def, atol=1e-12)
    _, after2 = recurrent_gated_delta_rule(q[:1, :3], k[:1, :3], v[:1, :3], g[:1, :3], beta[:1, :3],
                                           initial_state=dense[:1], output_final_state=True)
    assert torch.allclose(pool_s[2], after2[0])


# ---------------------------------------------------------------------------------- host checks (CPU)

def _tf32(x):
    """x rounded to tf32 (10 mantissa bits, round to nearest, ties away: cvt.rna)."""
    i = x.float().view(torch.int32)
    return (((i + (1 << 12)) >> 13) << 13).view(torch.float32).double()


def _block_step(q, k, v, g, beta, S0, products):
    """The tensor-core step's math for one (sequence, head) in float64, each matrix product through `products`
    (operands as the MMA sees them): q, k [T, K] (q scaled), v [T, V], g, beta [T], S0 [K, V]."""
    T = q.shape[0]
    G = torch.cumsum(g, 0)
    gamma = torch.exp(G)
    rel = torch.exp((G[:, None] - G[None, :]).clamp(max=0))
    A = torch.tril(beta[:, None] * (k @ k.T) * rel, -1)
    M = torch.tril((q @ k.T) * rel)
    inv = torch.linalg.inv(torch.eye(T, dtype=torch.float64) + A)
    U = products(inv, beta[:, None] * (v - gamma[:, None] * products(k, S0)))
    O = gamma[:, None] * products(q, S0) + products(M, U)
    S = gamma[-1] * S0 + products((k * torch.exp(G[-1] - G)[:, None]).T, U)
    return O, S


@pytest.mark.parametrize("decay", ["weak", "zero", "strong"])
def test_block_step_math_and_its_precision(decay):
    """The chunk form the tensor-core step runs equals the recurrence; with 3xTF32 products (hi hi + hi lo + lo hi)
    its state stays within 1e-6 of it, where single tf32 products are 1e-4 off (what the GPU test's 2e-5 tells
    apart)."""
    def exact(a, b):
        return a @ b

    def tf32(a, b):
        return _tf32(a) @ _tf32(b)

    def tf32x3(a, b):
        ah, bh = _tf32(a), _tf32(b)
        return ah @ bh + ah @ _tf32(b - bh) + _tf32(a - ah) @ bh

    gen = torch.Generator().manual_seed(5)
    for T in (2, 5, 8):
        q, k, v, g, beta = make(1, T, 1, 1, False, decay=decay, seed=T)
        q, k = F.normalize(q[0, :, 0].double(), dim=-1) * D ** -0.5, F.normalize(k[0, :, 0].double(), dim=-1)
        v, g, beta = v[0, :, 0].double(), g[0, :, 0].double(), beta[0, :, 0].double()
        S0 = torch.randn(D, D, generator=gen, dtype=torch.float64) * 0.5
        o_ref, s_ref = fused_recurrent_ref(q[None, :, None], k[None, :, None], v[None, :, None], g[None, :, None],
                                           beta[None, :, None], kda=False, scale=1.0, initial_state=S0[None, None],
                                           output_final_state=True)
        o_ref, s_ref = o_ref[0, :, 0], s_ref[0, 0]
        o, S = _block_step(q, k, v, g, beta, S0, exact)
        assert rel_err(o, o_ref) < 1e-12 and rel_err(S, s_ref) < 1e-12
        _, S = _block_step(q, k, v, g, beta, S0, tf32x3)
        assert rel_err(S, s_ref) < 1e-6, rel_err(S, s_ref)
        _, S = _block_step(q, k, v, g, beta, S0, tf32)
        assert rel_err(S, s_ref) > 2e-5, rel_err(S, s_ref)


@pytest.mark.parametrize("case, message", [
    ("v_heads", "multiple of q's and k's"),
    ("g_shape", "g must have shape"),
    ("neg_eig", "allow_neg_eigval=True requires"),
    ("no_alog", "A_log must be given"),
    ("pool_missing", "initial_state must be the state pool"),
    ("index_dtype", "initial_state_indices must have dtype"),
    ("spec_1d", "num_accepted_tokens needs initial_state_indices"),
    ("gk", "gk / gv"),
    ("v_first", "state_v_first"),
])
def test_argument_errors_name_the_argument(case, message):
    q, k, v, g, beta = make(2, 3, 2, 4, False)
    kw = {}
    if case == "v_heads":
        v = torch.randn(2, 3, 3, D, dtype=torch.bfloat16)
    elif case == "g_shape":
        g = g[:, :, :2].contiguous()
    elif case == "neg_eig":
        kw = dict(allow_neg_eigval=True)
    elif case == "no_alog":
        kw = dict(use_gate_in_kernel=True)
    elif case == "pool_missing":
        kw = dict(initial_state_indices=torch.zeros(2, dtype=torch.int32))
    elif case == "index_dtype":
        kw = dict(initial_state=torch.zeros(4, 4, D, D), initial_state_indices=torch.zeros(2, dtype=torch.int64))
    elif case == "spec_1d":
        kw = dict(initial_state=torch.zeros(4, 4, D, D), num_accepted_tokens=torch.ones(2, dtype=torch.int32))
    elif case == "gk":
        kw = dict(gk=g)
    elif case == "v_first":
        kw = dict(state_v_first=True)
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=message):
        ck.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, **kw)


def test_tensor_cores_where_they_measured_faster():
    """The planner's rule (docs/perf-history.md): GDN, 5..8 tokens a sequence, at least 256 (sequence, value head)
    items, no varlen or speculative writes."""
    use = recurrent_op.use_tensor_cores
    assert use(False, False, False, 8, 256) and use(False, False, False, 5, 8192)
    assert not use(False, False, False, 4, 8192) and not use(False, False, False, 8, 255)
    assert not use(True, False, False, 8, 8192) and not use(False, True, False, 8, 8192)
    assert not use(False, False, True, 8, 8192)


def test_requires_grad_raises():
    q, k, v, g, beta = make(1, 2, 1, 1, True)
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match="forward-only, but q requires grad"):
        ck.fused_recurrent_kda(q, k, v, g, beta)


def test_fake_shapes():
    op = torch.ops.cute_kernels.fused_recurrent
    with FakeTensorMode():
        q, k, v, g, beta = make(1, 6, 2, 4, True)
        cu = torch.tensor([0, 2, 6], dtype=torch.int32)
        o, final = op(q, k, v, g, beta, True, None, None, None, True, False, False, None, None, None, False, False,
                      cu, None, None, None)
        assert o.shape == v.shape and o.dtype == v.dtype
        assert final.shape == (2, 4, D, D) and final.dtype == torch.float32
        pool = torch.zeros(5, 4, D, D)
        _, none = op(q, k, v, g, beta, True, None, None, pool, True, False, False, None, None, None, False, False,
                     cu, torch.zeros(2, dtype=torch.int32), None, None)
        assert none.numel() == 0


def test_compile_traces_the_decode_step():
    from tests.test_torch_ops import _trace

    def step(q, k, v, g, beta, pool, idx):
        return ck.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=pool, output_final_state=True,
                                                   initial_state_indices=idx, final_state_indices=idx)

    q, k, v, g, beta = make(2, 1, 2, 4, False)
    graph = _trace(step, q, k, v, g, beta, torch.zeros(3, 4, D, D), torch.tensor([0, 2], dtype=torch.int32))
    assert "cute_kernels.fused_recurrent" in graph


# ------------------------------------------------------------------------------------------ kernel (GPU)

FLAGS = {
    "plain": dict(),
    "l2norm": dict(use_qk_l2norm_in_kernel=True),
    "gate": dict(use_gate_in_kernel=True, A_log=True, dt_bias=True),
    "gate_no_bias": dict(use_gate_in_kernel=True, A_log=True),
    "beta_sigmoid": dict(use_beta_sigmoid_in_kernel=True),
    "neg_eigval": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "all": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=True, dt_bias=True,
                use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "lower_bound": dict(use_gate_in_kernel=True, A_log=True, dt_bias=True, lower_bound=-5.0),
    "lower_bound_no_a": dict(use_gate_in_kernel=True, dt_bias=True, lower_bound=-5.0),
}


def _gate_params(flags, HV, kda, device):
    gen = torch.Generator().manual_seed(7)
    kw = dict(flags)
    if kw.pop("A_log", False):
        kw["A_log"] = (0.3 * torch.randn(HV, generator=gen) - 2.0).to(device)
    if kw.pop("dt_bias", False):
        kw["dt_bias"] = (0.5 * torch.randn((HV, D) if kda else (HV,), generator=gen)).to(device)
    return kw


def _call(kda, q, k, v, g, beta, **kw):
    if kda:
        return ck.fused_recurrent_kda(q, k, v, g, beta, **kw)
    return ck.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, **kw)


def _check(o, final, o_ref, final_ref, tol=2e-3):
    assert not torch.isnan(o).any() and (final is None or not torch.isnan(final).any())
    assert rel_err(o, o_ref) < tol, rel_err(o, o_ref)
    if final is not None:
        assert rel_err(final, final_ref) < tol, rel_err(final, final_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("Sq", [1, 2, 4, 8])
@pytest.mark.parametrize("decay", ["weak", "zero", "strong"])
def test_kernel_matches_spec(kda, group, Sq, decay):
    B, H = 3, 2
    q, k, v, g, beta = make(B, Sq, H, H * group, kda, "cuda", decay=decay, seed=Sq * 10 + group)
    s0 = torch.randn(B, H * group, D, D, device="cuda") * 0.5
    o_ref, f_ref = fused_recurrent_ref(q, k, v, g, beta, kda=kda, scale=0.2, initial_state=s0, output_final_state=True)
    outs = []
    for _ in range(2):   # poisoned outputs, twice: bitwise equal
        out = torch.full_like(v, float("nan"))
        o, final = _call(kda, q, k, v, g, beta, scale=0.2, initial_state=s0, output_final_state=True, out=out)
        outs.append((o.clone(), final.clone()))
    _check(*outs[0], o_ref, f_ref)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.fixture
def tensor_core_step(monkeypatch):
    """Every GDN step of 2..8 tokens on the tensor-core step, however small the call (the planner keeps it for
    large ones); fails the test if a call went token by token."""
    monkeypatch.setattr(recurrent_op, "TC_MIN_TOKENS", 2)
    monkeypatch.setattr(recurrent_op, "TC_MIN_ITEMS", 1)
    chosen = []
    planned = recurrent_op.use_tensor_cores
    monkeypatch.setattr(recurrent_op, "use_tensor_cores", lambda *a: chosen.append(planned(*a)) or chosen[-1])
    yield
    assert chosen and all(chosen), f"calls went token by token: {chosen}"


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("Sq", [2, 4, 8])
@pytest.mark.parametrize("decay", ["weak", "zero", "strong"])
def test_tensor_core_step_matches_spec(group, Sq, decay, tensor_core_step):
    test_kernel_matches_spec(False, group, Sq, decay)


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [f for f in FLAGS if "lower_bound" not in f])
def test_tensor_core_step_gate_flags(flags, tensor_core_step):
    test_kernel_gate_flags(False, flags)


@pytest.mark.gpu
@pytest.mark.parametrize("Sq", [2, 8])
@pytest.mark.parametrize("decay", ["weak", "zero"])
def test_kernel_state_is_fp32_accurate(Sq, decay, tensor_core_step):
    """The fp32 state after several tokens within 2e-5 of the float64 spec: the tensor-core step's products must be
    3xTF32 (plain tf32 is 2e-4 off, bf16 2e-3; the token-by-token step is 1e-7)."""
    q, k, v, g, beta = make(4, Sq, 2, 4, False, "cuda", decay=decay, seed=41 + Sq)
    s0 = torch.randn(4, 4, D, D, device="cuda") * 0.5
    _, f_ref = fused_recurrent_ref(q, k, v, g, beta, kda=False, initial_state=s0, output_final_state=True)
    _, final = _call(False, q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert not torch.isnan(final).any() and rel_err(final, f_ref) < 2e-5, rel_err(final, f_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("T", [9, 19])
def test_kernel_longer_than_a_group(kda, T):
    """More tokens than one staged group (the token count read at run time): groups of 8, the last one partial."""
    q, k, v, g, beta = make(2, T, 2, 4, kda, "cuda", decay="weak", seed=T)
    s0 = torch.randn(2, 4, D, D, device="cuda") * 0.5
    o_ref, f_ref = fused_recurrent_ref(q, k, v, g, beta, kda=kda, initial_state=s0, output_final_state=True)
    out = torch.full_like(v, float("nan"))
    o, final = _call(kda, q, k, v, g, beta, initial_state=s0, output_final_state=True, out=out)
    _check(o, final, o_ref, f_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("flags", list(FLAGS))
def test_kernel_gate_flags(kda, flags):
    if "lower_bound" in flags and not kda:
        pytest.skip("lower_bound is KDA's")
    q, k, v, g, beta = make(2, 4, 2, 4, kda, "cuda", raw_gates="gate" in flags or "lower" in flags)
    if "sigmoid" in flags or "eigval" in flags or flags == "all":
        beta = torch.randn_like(beta)
    kw = _gate_params(FLAGS[flags], 4, kda, "cuda")
    s0 = torch.randn(2, 4, D, D, device="cuda") * 0.5
    o_ref, f_ref = fused_recurrent_ref(q, k, v, g, beta, kda=kda, initial_state=s0, output_final_state=True, **kw)
    o, final = _call(kda, q, k, v, g, beta, initial_state=s0, output_final_state=True, **kw)
    _check(o, final, o_ref, f_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("flags", ["plain", "all", "lower_bound"])
def test_kernel_matches_fla(kda, flags):
    if flags == "lower_bound" and not kda:
        pytest.skip("lower_bound is KDA's")
    fla = import_peer("fla.ops.kda" if kda else "fla.ops.gated_delta_rule")
    q, k, v, g, beta = make(4, 3, 2, 4, kda, "cuda", raw_gates=flags != "plain")
    if flags == "all":
        beta = torch.randn_like(beta)
    kw = _gate_params(FLAGS[flags], 4, kda, "cuda")
    s0 = torch.randn(4, 4, D, D, device="cuda") * 0.5
    o, final = _call(kda, q, k, v, g, beta, initial_state=s0, output_final_state=True, **kw)
    if kda:
        o_fla, f_fla = fla.fused_recurrent_kda(q, k, v, g, beta, initial_state=s0.clone(), output_final_state=True,
                                               **kw)
    else:
        o_fla, f_fla = fla.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=s0.clone(),
                                                            output_final_state=True, **kw)
    assert rel_err(o, o_fla) < 5e-3 and rel_err(final, f_fla) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kda", [False, True])
def test_kernel_pool_in_place(kda):
    q, k, v, g, beta = make(4, 2, 2, 4, kda, "cuda")
    pool = torch.randn(8, 4, D, D, device="cuda") * 0.5
    init = torch.tensor([3, 3, -1, 6], dtype=torch.int32, device="cuda")   # a repeated slot and a zero start
    fin = torch.tensor([0, 1, -1, 6], dtype=torch.int32, device="cuda")    # one not written; one in place
    o_ref, pool_ref = fused_recurrent_ref(q, k, v, g, beta, kda=kda, initial_state=pool, output_final_state=True,
                                          initial_state_indices=init, final_state_indices=fin)
    mine = pool.clone()
    o, returned = _call(kda, q, k, v, g, beta, initial_state=mine, output_final_state=True,
                        initial_state_indices=init, final_state_indices=fin)
    assert returned is mine
    _check(o, mine, o_ref, pool_ref)
    for untouched in (2, 3, 4, 5, 7):
        assert torch.equal(mine[untouched], pool[untouched])


@pytest.mark.gpu
@pytest.mark.parametrize("kda", [False, True])
def test_kernel_speculative(kda):
    cu = torch.tensor([0, 4, 5, 8], dtype=torch.int32, device="cuda")
    q, k, v, g, beta = make(1, 8, 2, 2, kda, "cuda")
    pool = torch.randn(12, 2, D, D, device="cuda") * 0.5
    idx = torch.tensor([[0, 1, 2, 3], [4, -1, -1, -1], [8, 9, 10, -1]], dtype=torch.int32, device="cuda")
    acc = torch.tensor([3, 1, 2], dtype=torch.int32, device="cuda")
    o_ref, pool_ref = fused_recurrent_ref(q, k, v, g, beta, kda=kda, initial_state=pool, output_final_state=True,
                                          cu_seqlens=cu, initial_state_indices=idx, final_state_indices=idx,
                                          num_accepted_tokens=acc)
    mine = pool.clone()
    o, _ = _call(kda, q, k, v, g, beta, initial_state=mine, cu_seqlens=cu, initial_state_indices=idx,
                 num_accepted_tokens=acc)
    _check(o, mine, o_ref, pool_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["gdn", "kda", "gdn-tensor-cores"])
def test_back_to_back_steps_on_one_pool(form, monkeypatch):
    """Steps launched early (PDL) overlap the previous step's tail: each must still wait for it before reading the
    pool slot that step writes. Six steps in a row, each reading the slot the one before wrote, eagerly and as one
    CUDA graph; a small grid, so the next step's CTAs fit beside the previous one's."""
    kda = form == "kda"
    if form == "gdn-tensor-cores":
        monkeypatch.setattr(recurrent_op, "TC_MIN_TOKENS", 2)
        monkeypatch.setattr(recurrent_op, "TC_MIN_ITEMS", 1)
    steps, B, H, Sq = 6, 2, 2, 2
    inputs = [make(B, Sq, H, H, kda, "cuda", decay="weak", seed=40 + i) for i in range(steps)]
    pool = torch.randn(steps + 1, H, D, D, device="cuda") * 0.5
    slot = lambda i: torch.full((B,), i, dtype=torch.int32, device="cuda")   # noqa: E731
    # step i reads slot i (the one step i - 1 wrote) and writes slot i + 1; both rows of the batch share a slot
    # only for reading, so each step writes slot i + 1 from row 0 and drops row 1's state (index -1)
    reads = [slot(i) for i in range(steps)]
    writes = [torch.tensor([i + 1, -1], dtype=torch.int32, device="cuda") for i in range(steps)]
    outs = [torch.empty_like(inputs[i][2]) for i in range(steps)]

    def run(p):
        for i, (q, k, v, g, beta) in enumerate(inputs):
            _call(kda, q, k, v, g, beta, initial_state=p, output_final_state=True, initial_state_indices=reads[i],
                  final_state_indices=writes[i], out=outs[i])

    ref_pool, ref_outs = pool.clone(), []
    for i, (q, k, v, g, beta) in enumerate(inputs):
        o_ref, ref_pool = fused_recurrent_ref(q, k, v, g, beta, kda=kda, initial_state=ref_pool,
                                              output_final_state=True, initial_state_indices=reads[i],
                                              final_state_indices=writes[i])
        ref_outs.append(o_ref)
    mine = pool.clone()
    run(mine)   # eager (and compiles outside the capture)
    torch.cuda.synchronize()
    for o, o_ref in zip(outs, ref_outs):
        _check(o, None, o_ref, None)
    _check(outs[-1], mine, ref_outs[-1], ref_pool)
    graph = torch.cuda.CUDAGraph()
    captured = pool.clone()
    with torch.cuda.graph(graph):
        run(captured)
    captured.copy_(pool)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for o, o_ref in zip(outs, ref_outs):
        _check(o, None, o_ref, None)
    _check(outs[-1], captured, ref_outs[-1], ref_pool)


@pytest.mark.gpu
def test_kernel_graph_replay_with_new_lengths():
    """Captured once; replayed with new cu_seqlens contents, indices and inputs: nothing is read on the host."""
    torch.manual_seed(0)
    T, N = 12, 4
    q, k, v, g, beta = make(1, T, 2, 4, False, "cuda")
    cu = torch.tensor([0, 3, 6, 9, 12], dtype=torch.int32, device="cuda")
    pool = torch.randn(6, 4, D, D, device="cuda") * 0.5
    idx = torch.arange(N, dtype=torch.int32, device="cuda")
    o = torch.empty_like(v)
    args = dict(initial_state=pool, initial_state_indices=idx, final_state_indices=idx, cu_seqlens=cu, out=o)
    _call(False, q, k, v, g, beta, **args)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    saved = pool.clone()
    with torch.cuda.graph(graph):
        _call(False, q, k, v, g, beta, **args)
    for lengths, slots in [((1, 8, 0, 3), (5, 4, 1, 0)), ((12, 0, 0, 0), (2, -1, 3, 4))]:
        pool.copy_(saved)
        cu.copy_(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32))
        idx.copy_(torch.tensor(slots, dtype=torch.int32))
        o_ref, pool_ref = fused_recurrent_ref(q, k, v, g, beta, kda=False, initial_state=saved,
                                              output_final_state=True, cu_seqlens=cu.cpu(),
                                              initial_state_indices=idx.cpu(), final_state_indices=idx.cpu())
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(o, pool, o_ref, pool_ref)


@pytest.mark.gpu
def test_compiled_step_equals_eager():
    q, k, v, g, beta = make(2, 1, 2, 4, True, "cuda")
    pool = torch.randn(3, 4, D, D, device="cuda")
    idx = torch.tensor([2, 0], dtype=torch.int32, device="cuda")

    def step(q, k, v, g, beta, pool):
        return ck.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, initial_state_indices=idx,
                                      final_state_indices=idx, output_final_state=True)

    eager_pool, compiled_pool = pool.clone(), pool.clone()
    o_e, _ = step(q, k, v, g, beta, eager_pool)
    torch._dynamo.reset()
    o_c, _ = torch.compile(step, fullgraph=True)(q, k, v, g, beta, compiled_pool)
    assert torch.equal(o_e, o_c) and torch.equal(eager_pool, compiled_pool)
