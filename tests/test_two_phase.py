"""Two-phase chunked forward (issue 5, experimental): phase 1's terms (torch) and phase 2's contract on the CPU
against the float64 reference; the SM90 state pass on the GPU."""

import pytest
import torch
import torch.nn.functional as F
from conftest import gpu_arch, poisoned, rel_err

from cute_kernels import reference as ref
from cute_kernels.ops import two_phase

requires_sm90 = pytest.mark.skipif(gpu_arch() != "sm_90a", reason="needs an SM90 (Hopper) GPU")


def make(B, T, H, kda, gen, dtype=torch.float32, device="cpu", V=128):
    q = F.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn((B, T, H, 128) if kda else (B, T, H), generator=gen) + 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    init = torch.randn(B, H, 128, V, generator=gen) * 0.1
    cast = lambda x: x.to(dtype).to(device)   # noqa: E731
    return cast(q), cast(k), cast(v), g.to(device), cast(beta), init.to(device)


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("T", [64, 200])
def test_prep_and_state_pass_contract_match_reference(kda, T):
    """chunk_prep_torch + state_pass_torch (the kernel's per-chunk math, incl. a partial last chunk) equal the
    chunked reference."""
    gen = torch.Generator().manual_seed(5 + T + kda)
    q, k, v, g, beta, init = make(2, T, 2, kda, gen)
    prep = two_phase.chunk_prep_torch(q, k, v, g, beta, kda=kda)
    assert prep.aqk.shape == (2, T, 2, 64) and prep.eg.shape == ((2, T, 2, 128) if kda else (2, T, 2))
    assert all(t.is_contiguous() for t in (prep.qg, prep.w, prep.u, prep.kg, prep.aqk, prep.eg))
    # Aqk rows are lower triangular inside their chunk.
    r = torch.arange(T) % 64
    upper = torch.arange(64)[None, :] > r[:, None]                     # [T, 64]: columns above the diagonal
    assert (prep.aqk.permute(0, 2, 1, 3)[:, :, upper] == 0).all()
    o, s = two_phase.state_pass_torch(prep, init)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init, output_final_state=True)
    assert rel_err(o, want_o) < 1e-4 and rel_err(s, want_s) < 1e-4


def test_state_pass_rejects_bad_terms():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta, _ = make(1, 64, 1, False, gen)
    prep = two_phase.chunk_prep_torch(q, k, v, g, beta, kda=False)
    bad = two_phase.PrepTerms(prep.qg, prep.w, prep.u, prep.kg, prep.aqk[..., :32].contiguous(), prep.eg, False)
    with pytest.raises(ValueError, match="aqk must have shape"):
        two_phase.state_pass(bad)
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        two_phase.state_pass(prep)


@requires_sm90
@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("B,T,H,with_init", [(1, 64, 1, False), (2, 1000, 3, True), (1, 4096, 4, True)])
def test_state_pass_kernel_matches_reference(kda, B, T, H, with_init):
    gen = torch.Generator().manual_seed(B * T + H + kda)
    q, k, v, g, beta, init = make(B, T, H, kda, gen, dtype=torch.bfloat16, device="cuda")
    init = init if with_init else None
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init, output_final_state=True)
    prep = two_phase.chunk_prep_torch(q, k, v, g, beta, kda=kda)
    runs = []
    for _ in range(2):
        out = (poisoned((B, T, H, 128), torch.bfloat16, "cuda"), poisoned((B, H, 128, 128), torch.float32, "cuda"))
        o, s = two_phase.state_pass(prep, init, output_final_state=True, out=out)
        assert o is out[0] and s is out[1]
        assert not o.isnan().any() and not s.isnan().any()
        runs.append((o, s))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), "run-to-run difference"
    o, s = runs[0]
    assert rel_err(o, want_o) <= 5e-3 and rel_err(s, want_s) <= 5e-3, (rel_err(o, want_o), rel_err(s, want_s))


def chunk_last_rows(T, B):
    """Token rows (flattened [B * T]) that end a chunk of their sequence."""
    ends = [min(c + 64, T) - 1 for c in range(0, T, 64)]
    return torch.tensor([b * T + e for b in range(B) for e in ends])


@requires_sm90
@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("B,T,H", [(1, 64, 1), (2, 1000, 3), (1, 4096, 4)])
def test_prep_kernel_matches_torch_prep(kda, B, T, H):
    gen = torch.Generator().manual_seed(100 + B * T + H + kda)
    q, k, v, g, beta, _ = make(B, T, H, kda, gen, dtype=torch.bfloat16, device="cuda")
    want = two_phase.chunk_prep_torch(q, k, v, g, beta, kda=kda)
    got = two_phase.chunk_prep(q, k, v, g, beta, kda=kda)
    again = two_phase.chunk_prep(q, k, v, g, beta, kda=kda)
    for name in ("qg", "w", "u", "kg", "aqk"):
        x, y = getattr(got, name), getattr(want, name)
        assert not x.isnan().any(), name
        assert rel_err(x, y) <= 1e-2, (name, rel_err(x, y))
        assert torch.equal(x, getattr(again, name)), f"{name}: run-to-run difference"
    rows = chunk_last_rows(T, B).cuda()
    eg, eg_want = got.eg.flatten(0, 1)[rows], want.eg.flatten(0, 1)[rows]
    assert rel_err(eg, eg_want) <= 1e-5


@requires_sm90
@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("B,T,H,with_init", [(2, 1000, 3, True), (1, 4096, 4, False)])
def test_two_phase_matches_reference(kda, B, T, H, with_init):
    gen = torch.Generator().manual_seed(200 + B * T + H + kda)
    q, k, v, g, beta, init = make(B, T, H, kda, gen, dtype=torch.bfloat16, device="cuda")
    init = init if with_init else None
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init, output_final_state=True)
    o, s = two_phase.chunk_gated_delta_rule_two_phase(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                                      kda=kda)
    o2, s2 = two_phase.chunk_gated_delta_rule_two_phase(q, k, v, g, beta, initial_state=init,
                                                        output_final_state=True, kda=kda)
    assert not o.isnan().any() and not s.isnan().any()
    assert torch.equal(o, o2) and torch.equal(s, s2), "run-to-run difference"
    assert rel_err(o, want_o) <= 5e-3 and rel_err(s, want_s) <= 5e-3, (rel_err(o, want_o), rel_err(s, want_s))
