"""The two-phase forward: phase 1's terms (torch spec) and phase 2's contract against the float64 reference, the
path's orchestration with both kernels emulated (CPU); the kernels themselves, the op's two-phase and overlapped
paths (GPU)."""

import pytest
import torch
from conftest import poisoned, rel_err, requires_sm90
from emulation import emulate
from inputs import GATE_REGIMES, initial_state, make_inputs

import cute_kernels.ops.linear_attention as la
from cute_kernels import reference as ref
from cute_kernels.kernels.configs import PrepConfig, StateConfig
from cute_kernels.paths import two_phase
from cute_kernels.paths.two_phase import ChunkTerms, OverlapRun, PrepRun, StateRun, chunk_prep_torch, state_pass_torch
from cute_kernels.plan import PlanOptions
from schedulers import SegmentScheduler

TWO_PHASE = PlanOptions(path="two_phase", overlap="never")


def make(B, T, H, kda, gen, dtype=torch.float32, device="cpu", regime="moderate"):
    """(q, k, v, g, beta, initial state [B, H, 128, 128]) in `regime` (default: moderate gates, ~-0.18 per step)."""
    q, k, v, g, beta = make_inputs(B, T, H, gen, device, dtype, kda=kda, regime=regime)
    return q, k, v, g, beta, initial_state(B, H, gen, device)


def call(kda, q, k, v, g, beta, *, initial_state=None, output_final_state=True, cu_seqlens=None, scheduler=None,
         out=None, options=TWO_PHASE):
    return la.forward(q, k, v, g, beta, None, initial_state, output_final_state, cu_seqlens, False, scheduler, out,
                      kda=kda, options=options)


def with_token_factors(terms: ChunkTerms, q, k, v, scale=128 ** -0.5) -> ChunkTerms:
    """GDN's folded terms from `chunk_prep_torch(folded=True)` as phase 1 writes them: the call's q, k, v and the
    per-token factors (scale 2^G, 2^(G_L - G), 2^G_L, 2^G)."""
    T = q.shape[1]
    eG = terms.decay.float()
    last = torch.tensor([min(t - t % 64 + 63, T - 1) for t in range(T)])
    decay = torch.stack([scale * eG, eG[:, last] / eG, eG[:, last], eG], -1).contiguous()
    return ChunkTerms(q, k, v, terms.update_key, terms.intra, decay, False, folded=True, token_factors=True)


# ---------------------------------------------------------------- CPU: the terms and the state pass's contract


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("folded", [False, True], ids=["solved", "folded"])
@pytest.mark.parametrize("T", [64, 200])
@pytest.mark.parametrize("regime", ["moderate", "weak"])
def test_terms_and_state_pass_contract_match_reference(kda, folded, T, regime):
    """`chunk_prep_torch` (solved or folded terms, a partial last chunk included) + `state_pass_torch` (the
    kernel's per-chunk math) equal the chunked reference; folded: key = k (GDN) or exp(G) k (KDA), value = v, and
    A1 = Aqk T keeps Aqk's lower-triangular rows (row r reads tokens <= r only)."""
    gen = torch.Generator().manual_seed(5 + T + kda + 2 * folded + 4 * (regime == "weak"))
    q, k, v, g, beta, init = make(2, T, 2, kda, gen, regime=regime)
    terms = chunk_prep_torch(q, k, v, g, beta, kda=kda, folded=folded)
    assert terms.intra.shape == (2, T, 2, 64) and terms.decay.shape == ((2, T, 2, 128) if kda else (2, T, 2))
    assert all(t.is_contiguous() for t in terms.tensors)
    r = torch.arange(T) % 64
    upper = torch.arange(64)[None, :] > r[:, None]                     # [T, 64]: columns above the diagonal
    assert (terms.intra.permute(0, 2, 1, 3)[:, :, upper].abs() < 1e-6).all()
    if folded:
        assert torch.equal(terms.value, v) and torch.equal(terms.key, k) != kda
    o, s = state_pass_torch(terms, init)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init, output_final_state=True)
    assert rel_err(o, want_o) < 1e-4 and rel_err(s, want_s) < 1e-4


def test_token_factor_terms_equal_the_gated_ones():
    """GDN's folded terms with per-token factors (as phase 1 writes them) run the same chain: `gated()` gives the
    torch spec's terms back, and the state pass spec agrees on both."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta, init = make(1, 200, 2, False, gen)
    spec = chunk_prep_torch(q, k, v, g, beta, kda=False, folded=True)
    raw = with_token_factors(spec, q, k, v)
    gated = raw.gated()
    assert torch.allclose(gated.query, spec.query) and torch.allclose(gated.decay, spec.decay)
    o1, s1 = state_pass_torch(spec, init)
    o2, s2 = state_pass_torch(raw, init)
    assert rel_err(o2, o1) < 1e-6 and rel_err(s2, s1) < 1e-6


def test_state_pass_rejects_bad_terms():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta, _ = make(1, 64, 1, False, gen)
    terms = chunk_prep_torch(q, k, v, g, beta, kda=False)
    bad = ChunkTerms(*terms.tensors[:4], terms.intra[..., :32].contiguous(), terms.decay, False)
    with pytest.raises(ValueError, match="intra must have shape"):
        two_phase.state_pass(bad)
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        two_phase.state_pass(terms)


# ---------------------------------------------------------------- CPU: the path's orchestration, kernels emulated


@pytest.fixture
def builds(monkeypatch):
    monkeypatch.setattr(StateRun, "poison", True)   # summary slots never written must never be read
    monkeypatch.setattr(PrepRun, "poison", True)    # terms never written must never be read
    return emulate(monkeypatch)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("num_segments", [1, 3, 8])
@pytest.mark.parametrize("with_init", [True, False])
@pytest.mark.parametrize("regime", GATE_REGIMES)
def test_segmented_state_pass_orchestration(builds, kda, num_segments, with_init, regime):
    """The state pass (`StateRun`) on the torch spec's terms, its kernel emulated: the forward launch, or the
    summary launch, the merge and the segment outputs."""
    gen = torch.Generator().manual_seed(num_segments + 2 * kda + 4 * with_init + 8 * GATE_REGIMES.index(regime))
    q, k, v, g, beta, init = make(2, 1000, 2, kda, gen, regime=regime)
    init = init if with_init else None
    terms = chunk_prep_torch(q, k, v, g, beta, kda=kda, folded=True)
    if not kda:
        terms = with_token_factors(terms, q, k, v)
    run = StateRun(kda, not kda, 2, 1000, 2, None, torch.float32, with_init, True, num_segments, "regs",
                   torch.device("cpu"))
    o, s = run.run(terms, init, torch.empty_like(v), torch.empty(2, 2, 128, 128))
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init, output_final_state=True)
    modes = [b.mode for b in builds if isinstance(b, StateConfig)]
    assert modes == (["forward"] if num_segments == 1 else ["summary", "segment_outputs"])
    assert rel_err(o, want_o) < 1e-4 and rel_err(s, want_s) < 1e-4, (rel_err(o, want_o), rel_err(s, want_s))


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("segments", [None, 4])
@pytest.mark.parametrize("regime", GATE_REGIMES)
def test_two_phase_op_wiring(builds, kda, varlen, segments, regime):
    """chunk_gated_delta_rule / chunk_kda on the two-phase path: phase 1 (the folded build) + the (segmented) state
    pass wired from the op, checked with both kernels emulated; the call's v is never written (KDA's folded terms
    read it as value)."""
    gen = torch.Generator().manual_seed(11 + kda + 2 * varlen + 4 * GATE_REGIMES.index(regime))
    B, T = (1, 1300) if varlen else (2, 700)
    q, k, v, g, beta, _ = make(B, T, 2, kda, gen, dtype=torch.bfloat16, regime=regime)
    cu = (0, 100, 100, 1000, 1300) if varlen else None
    N = 4 if varlen else B
    init = torch.randn(N, 2, 128, 128, generator=gen) * 0.1
    cut = torch.tensor(cu) if varlen else None
    v_before = v.clone()
    sched = None if segments is None else SegmentScheduler(num_segments=segments)
    o, s = call(kda, q, k, v, g, beta, initial_state=init, cu_seqlens=cut, scheduler=sched)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                                   cu_seqlens=cut)
    plan = la._last[0]
    assert segments is None or plan.segments == segments, la.explain_last()
    assert [b.terms for b in builds if isinstance(b, PrepConfig)] == ["folded"] and torch.equal(v, v_before)
    modes = [b.mode for b in builds if isinstance(b, StateConfig)]
    assert modes == (["summary", "segment_outputs"] if plan.segments > 1 else ["forward"]), modes
    assert all(b.token_factors == (not kda) for b in builds if isinstance(b, StateConfig))
    # bf16 terms and output: 2.6e-3 (o) and 1.7e-3 (state) at most over these cases
    assert rel_err(o, want_o) < 5e-3 and rel_err(s, want_s) < 5e-3, (rel_err(o, want_o), rel_err(s, want_s))


def test_two_phase_op_writes_into_out(builds):
    """`out=` on the two-phase path: results land in the given (NaN-poisoned) tensors, bad ones are rejected before
    any launch, and output_final_state=False still fills a given final-state tensor but returns None."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta, init = make(2, 300, 2, False, gen, dtype=torch.bfloat16)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init, output_final_state=True)
    o = torch.full_like(v, float("nan"))
    s = torch.full((2, 2, 128, 128), float("nan"))
    got_o, got_s = call(False, q, k, v, g, beta, initial_state=init, output_final_state=False, out=(o, s))
    assert got_o is o and got_s is None
    assert rel_err(o, want_o) < 5e-3 and rel_err(s, want_s) < 5e-3
    with pytest.raises(ValueError, match=r"out\[o\]"):
        call(False, q, k, v, g, beta, out=(o[:, :100], None))
    with pytest.raises(TypeError, match=r"out\[final_state\]"):
        call(False, q, k, v, g, beta, out=(o, s.double()))


def test_eager_fused_call_builds_the_graph_paths_runner(builds, monkeypatch):
    """A short GDN call goes fused when eager but two-phase under CUDA-graph capture, where nothing can be copied
    to the GPU: the eager call builds the two-phase runner too, so the captured call only launches."""
    capturing = [False]
    monkeypatch.setattr(la, "is_capturing", lambda device: capturing[0])
    q, k, v, g, beta, _ = make(1, 256, 4, False, torch.Generator().manual_seed(5), dtype=torch.bfloat16)
    auto = PlanOptions(path="auto")
    call(False, q, k, v, g, beta, options=auto)
    assert la._last[1] == "fused"
    assert sorted(r[1] for r in la._runs) == ["fused", "two_phase"]   # ... and the two-phase runner exists
    built = len(builds)
    capturing[0] = True
    o, _ = call(False, q, k, v, g, beta, options=auto)
    assert la._last[1] == "two_phase" and len(builds) == built      # captured: two-phase, nothing new built
    want, _ = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta)
    assert rel_err(o, want) < 5e-3


def test_prep_workspace_is_kept_per_stream_and_only_for_the_op(monkeypatch):
    """The op's small calls reuse one set of phase-1 outputs per (runner, stream); large or captured calls get
    fresh ones; the kept bytes stay under WORKSPACE_TOTAL_BYTES; the slots phase 1 does not write are the call's
    tensors."""
    stream = [7]
    monkeypatch.setattr(two_phase, "workspace_stream", lambda device: stream[0])
    monkeypatch.setattr(two_phase, "_workspaces", {})
    monkeypatch.setattr(two_phase, "_workspace_bytes", 0)
    run = PrepRun.__new__(PrepRun)
    run.config, run.shape, run.device = PrepConfig(kda=False), (1, 128, 2), torch.device("cpu")
    run.term_bytes = 1 << 20
    q, k, v = (torch.randn(1, 128, 2, 128) for _ in range(3))
    a, b = run.terms(torch.bfloat16, q, k, v), run.terms(torch.bfloat16, q, k, v)
    assert a.update_key is b.update_key and a.query is q and a.key is k and a.value is v and a.token_factors
    assert a.decay.shape == (1, 128, 2, 4) and a.update_key.shape == (1, 128, 2, 128)
    stream[0] = 8                       # another stream: its own outputs
    c = run.terms(torch.bfloat16, q, k, v)
    assert c.update_key.data_ptr() != a.update_key.data_ptr()
    stream[0] = None                    # graph capture (or not CUDA): fresh every call
    assert run.terms(torch.bfloat16, q, k, v).update_key is not run.terms(torch.bfloat16, q, k, v).update_key
    stream[0] = 7
    run.term_bytes = two_phase.WORKSPACE_TERM_BYTES + 1   # too large to keep
    assert run.terms(torch.bfloat16, q, k, v).update_key is not run.terms(torch.bfloat16, q, k, v).update_key
    run.term_bytes = two_phase.WORKSPACE_TOTAL_BYTES // 2 + 1
    monkeypatch.setattr(two_phase, "WORKSPACE_TERM_BYTES", two_phase.WORKSPACE_TOTAL_BYTES)
    stream[0] = 9
    run.terms(torch.bfloat16, q, k, v)
    stream[0] = 10
    run.terms(torch.bfloat16, q, k, v)  # would pass the total: the kept ones are dropped first
    assert two_phase._workspace_bytes <= two_phase.WORKSPACE_TOTAL_BYTES and len(two_phase._workspaces) == 1


def test_overlap_run_tables(builds):
    """The overlapped path's runner (CPU, kernels emulated): phase-1 tiles chunk-major on the SMs the state CTAs
    leave, one flag per (sequence, chunk, head); the builds it runs (GDN solved, KDA folded; the consuming state
    pass); a grid past half the SMs is refused."""
    from schedulers import TILE_FIELDS

    cpu = torch.device("cpu")
    run = OverlapRun(2, 1000, 3, False, torch.bfloat16, torch.bfloat16, True, True, cpu, 132)
    assert run.state_ctas == 2 * 2 * 3 and run.prep_ctas == 96   # min(tiles, SMs - state CTAs)
    assert run.chunks_per_seq == 16 and run.flag_count == 2 * 16 * 3
    table = run.prep_launch[0]
    starts = table[:, TILE_FIELDS.index("chunk_start")].tolist()
    assert starts == sorted(starts) and len(starts) == 2 * 3 * 16   # one-chunk tiles, chunk-major
    assert run.prep_config == PrepConfig(kda=False, terms="solved", ctas_per_sm=1, publish=True)
    assert StateConfig(False, "forward", True, True, consume=True) in builds
    kda_run = OverlapRun(1, 512, 4, True, torch.bfloat16, torch.bfloat16, False, False, cpu, 132)
    assert kda_run.prep_config.terms == "folded" and kda_run.prep_config.publish
    with pytest.raises(ValueError, match="state CTAs"):
        OverlapRun(8, 128, 8, False, torch.bfloat16, torch.bfloat16, False, False, cpu, 132)


# ---------------------------------------------------------------- GPU: the kernels, the paths


def chunk_last_rows(T, B):
    """Token rows (flattened [B * T]) that end a chunk of their sequence."""
    ends = [min(c + 64, T) - 1 for c in range(0, T, 64)]
    return torch.tensor([b * T + e for b in range(B) for e in ends])


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("B,T,H,with_init", [(1, 64, 1, False), (2, 1000, 3, True), (1, 4096, 4, True)])
@pytest.mark.parametrize("regime", ["moderate", "weak", "zero"])
def test_state_pass_kernel_matches_reference(kda, B, T, H, with_init, regime):
    """The state pass alone on the torch spec's folded terms (GDN: with per-token factors): NaN-poisoned outputs,
    run-to-run bitwise, float64 reference."""
    gen = torch.Generator().manual_seed(B * T + H + kda)
    q, k, v, g, beta, init = make(B, T, H, kda, gen, dtype=torch.bfloat16, device="cuda", regime=regime)
    init = init if with_init else None
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init, output_final_state=True)
    terms = chunk_prep_torch(q, k, v, g, beta, kda=kda, folded=True)
    if not kda:
        terms = with_token_factors(terms, q, k, v)
    runs = []
    for _ in range(2):
        out = (poisoned((B, T, H, 128), torch.bfloat16, "cuda"), poisoned((B, H, 128, 128), torch.float32, "cuda"))
        o, s = two_phase.state_pass(terms, init, output_final_state=True, out=out)
        assert o is out[0] and s is out[1]
        assert not o.isnan().any() and not s.isnan().any()
        runs.append((o, s))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), "run-to-run difference"
    o, s = runs[0]
    assert rel_err(o, want_o) <= 5e-3 and rel_err(s, want_s) <= 5e-3, (rel_err(o, want_o), rel_err(s, want_s))


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("B,T,H,chunks_per_tile,sms", [(1, 64, 1, None, 132), (2, 1000, 3, 1, 132),
                                                        (2, 1000, 3, 2, 132), (1, 4096, 4, None, 132),
                                                        (1, 4096, 4, 1, 40), (8, 512, 16, None, 132),
                                                        (1, 16384, 4, None, 132)])
def test_prep_kernel_matches_torch_prep(kda, B, T, H, chunks_per_tile, sms, monkeypatch):
    """Phase 1's folded terms against the torch spec on tiles of 1, 2 or the planner's (balanced: 2-3) chunks; GDN
    at two and (sms=40: 256 tiles > 80 slots) three CTAs per SM; KDA with every other chunk past the anchor limit
    (channel 5 decays by -6 per step: the exact path) and partial last chunks; NaN-poisoned outputs, run-to-run
    bitwise; q, k, v never written."""
    monkeypatch.setattr(PrepRun, "poison", True)
    gen = torch.Generator().manual_seed(100 + B * T + H + kda)
    q, k, v, g, beta, _ = make(B, T, H, kda, gen, dtype=torch.bfloat16, device="cuda")
    if kda:
        g[:, (torch.arange(T, device="cuda") // 64) % 2 == 1, :, 5] = -6.0
    before = [x.clone() for x in (q, k, v)]
    want = chunk_prep_torch(q, k, v, g, beta, kda=kda, folded=True)
    got = two_phase.chunk_prep(q, k, v, g, beta, kda=kda, chunks_per_tile=chunks_per_tile, sms=sms)
    again = two_phase.chunk_prep(q, k, v, g, beta, kda=kda, chunks_per_tile=chunks_per_tile, sms=sms)
    assert all(torch.equal(x, y) for x, y in zip((q, k, v), before))
    assert got.folded and got.token_factors == (not kda) and got.value is v
    written = ("query", "key", "update_key", "intra") if kda else ("update_key", "intra", "decay")
    for name in written:
        x = getattr(got, name)
        assert not x.isnan().any(), name
        assert torch.equal(x, getattr(again, name)), f"{name}: run-to-run difference"
    if not kda:
        assert rel_err(got.decay[..., 3], want.decay) <= 1e-5   # every row: 2^G
        assert rel_err(got.decay[..., 0], 128 ** -0.5 * want.decay) <= 1e-5
    got = got.gated()
    # 16-bit terms: rel. err. ~1e-3 measured; a wrong term (a dropped beta, a wrong decay) is off by far more
    for name in ("query", "key", "update_key", "intra"):
        x, y = getattr(got, name), getattr(want, name)
        assert rel_err(x, y) <= 1e-2, (name, rel_err(x, y))
    rows = chunk_last_rows(T, B).cuda()
    assert rel_err(got.decay.flatten(0, 1)[rows], want.decay.flatten(0, 1)[rows]) <= 1e-5


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_prep_solve_on_repeated_keys(kda, monkeypatch):
    """The solve where I + Akk is worst conditioned: one key repeated through every chunk (beta 0.95). W2 and A1
    against the fp32 torch spec: a solve whose second-order terms are wrong passes on random keys (they are
    ~1e-3 there) but not here."""
    monkeypatch.setattr(PrepRun, "poison", True)
    gen = torch.Generator().manual_seed(31 + kda)
    q, k, v, g, beta, _ = make(1, 1024, 2, kda, gen, dtype=torch.bfloat16, device="cuda")
    k = k[:, :1].expand_as(k).contiguous()
    beta = torch.full_like(beta, 0.95)
    want = chunk_prep_torch(q, k, v, g, beta, kda=kda, folded=True)
    got = two_phase.chunk_prep(q, k, v, g, beta, kda=kda).gated()
    for name in ("update_key", "intra"):
        x = getattr(got, name)
        assert not x.isnan().any() and rel_err(x, getattr(want, name)) <= 1e-2, (name, rel_err(x, getattr(want, name)))


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("regime", GATE_REGIMES)
@pytest.mark.parametrize("N,merge", [(1, "regs"), (8, "regs"), (8, "tc")])
@pytest.mark.parametrize("with_init", [False, True])
def test_two_phase_gate_regimes(kda, regime, N, merge, with_init, monkeypatch):
    """The two-phase path on a long sequence (T = 4100: not a multiple of 64) in every gate regime: one state-pass
    segment, or 8 joined by each merge the planner picks for K = V = 128; NaN-poisoned terms and summaries,
    run-to-run bitwise, float64 reference."""
    monkeypatch.setattr(StateRun, "poison", True)
    monkeypatch.setattr(PrepRun, "poison", True)
    gen = torch.Generator().manual_seed(600 + N + 2 * kda + 4 * with_init + 8 * GATE_REGIMES.index(regime))
    q, k, v, g, beta, init = make(1, 4100, 4, kda, gen, dtype=torch.bfloat16, device="cuda", regime=regime)
    init = init if with_init else None
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init, output_final_state=True)
    options = PlanOptions("two_phase", overlap="never", merge=merge)
    runs = [call(kda, q, k, v, g, beta, initial_state=init, scheduler=SegmentScheduler(num_segments=N),
                 options=options) for _ in range(2)]
    assert la._last[0].segments == N and la._last[1] == "two_phase"
    (o, s), (o2, s2) = runs
    assert not o.isnan().any() and not s.isnan().any()
    assert torch.equal(o, o2) and torch.equal(s, s2), "run-to-run difference"
    assert rel_err(o, want_o) <= 5e-3 and rel_err(s, want_s) <= 5e-3, (rel_err(o, want_o), rel_err(s, want_s))


OVERLAP_CASES = ([(B, T, H, init, "moderate") for B, T, H, init in [(2, 1000, 3, True), (4, 640, 8, False)]]
                 + [(B, T, H, init, r) for r in GATE_REGIMES for B, T, H, init in [(1, 4096, 4, False),
                                                                                  (1, 2048, 16, True)]])


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("B,T,H,with_init,regime", OVERLAP_CASES)
def test_overlapped_path_matches_reference(kda, B, T, H, with_init, regime, monkeypatch):
    """The overlapped path (phase 1 publishing per chunk on a side stream, the state pass consuming it at once):
    NaN-poisoned terms, float64 reference, bitwise equal to itself over three calls, every flag back at 0."""
    monkeypatch.setattr(OverlapRun, "poison", True)
    gen = torch.Generator().manual_seed(300 + B * T + H + kda + 1000 * (GATE_REGIMES + ("moderate",)).index(regime))
    q, k, v, g, beta, init = make(B, T, H, kda, gen, dtype=torch.bfloat16, device="cuda", regime=regime)
    init = init if with_init else None
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init, output_final_state=True)
    runs = []
    for _ in range(3):
        o = poisoned(v.shape, v.dtype, "cuda")
        s = poisoned((B, H, 128, 128), torch.float32, "cuda")
        call(kda, q, k, v, g, beta, initial_state=init, out=(o, s), options=PlanOptions("two_phase",
                                                                                       overlap="always"))
        assert "overlapped" in la.explain_last(), la.explain_last()
        runs.append((o, s))
    torch.cuda.synchronize()
    (o, s), (o1, s1), (o2, s2) = runs
    assert not o.isnan().any() and not s.isnan().any()
    assert all(torch.equal(o, x) and torch.equal(s, y) for x, y in ((o1, s1), (o2, s2))), "run-to-run difference"
    assert rel_err(o, want_o) <= 5e-3 and rel_err(s, want_s) <= 5e-3, (rel_err(o, want_o), rel_err(s, want_s))
    run = next(r for key, r in la._runs.items() if key[1] == "overlap")
    assert all(int(f.abs().sum()) == 0 for f in run.flags_by_stream.values()), "flags not back at 0"


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("path", ["two_phase", "overlap", "fused"])
def test_two_streams_at_once(kda, path):
    """Two calls of one shape on two streams at once (each stream its own workspace and flags; an overlapped call
    while another may still run on the other stream takes the plain path): both right, and each equal to the
    same call made alone (bitwise, but where an overlapped call fell back to the plain path: its terms round
    differently)."""
    gen = torch.Generator().manual_seed(77 + kda)
    options = (PlanOptions("fused") if path == "fused" else
               PlanOptions("two_phase", overlap="always" if path == "overlap" else "never"))
    inputs = [make(1, 2048, 8, kda, gen, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    alone = [call(kda, *x[:5], initial_state=x[5], options=options) for x in inputs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    results = [None, None]
    for _ in range(3):
        for i in (0, 1):
            streams[i].wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(streams[i]):
                results[i] = call(kda, *inputs[i][:5], initial_state=inputs[i][5], options=options)
        torch.cuda.synchronize()
        for (o, s), (o1, s1) in zip(results, alone):
            if path == "overlap":
                assert rel_err(o, o1) <= 5e-3 and rel_err(s, s1) <= 5e-3
            else:
                assert torch.equal(o, o1) and torch.equal(s, s1), "a call on another stream changed the result"
