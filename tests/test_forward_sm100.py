"""SM100 GDN and KDA forward (the fused kernel, `kernels/sm100/fused.py`) through the op, against float64: GPU tests
for an SM100 machine (`scripts/device_check.sh sm100`); elsewhere they skip. `run_and_check` is the SM90 file's:
outputs NaN-poisoned before each of two runs, which must be bitwise equal, then within 5e-3 of the reference."""

import pytest
import torch
from inputs import GATE_REGIMES
from test_gdn_sm90 import LONG_AND_SHORT, run_and_check

import cute_kernels.ops.linear_attention as la
from cute_kernels.plan import PlanOptions

requires_sm100 = pytest.mark.gpu(arch="sm_100a")
OPS = pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])


@pytest.fixture
def fused(monkeypatch):
    from cute_kernels.paths.fused import FusedRun

    monkeypatch.setattr(FusedRun, "poison", True)
    return PlanOptions(path="auto")   # SM100 plans the fused path only (segmented where the costs say so)


@requires_sm100
@OPS
@pytest.mark.parametrize("T", [1, 64, 100, 1000, 4100])
@pytest.mark.parametrize("B,H", [(1, 1), (3, 4)])
@pytest.mark.parametrize("with_init", [False, True])
def test_matches_reference(kda, B, T, H, with_init, fused):
    run_and_check(fused, B, T, H, torch.Generator().manual_seed(T * 100 + B * 10 + H + with_init + 7 * kda),
                  with_init, kda=kda)


@requires_sm100
@OPS
@pytest.mark.parametrize("regime", GATE_REGIMES)
@pytest.mark.parametrize("cu", [None, [0, 1, 65, 65, 1000, 1063, 3000], LONG_AND_SHORT],
                         ids=["dense", "mixed", "long-and-short"])
def test_gate_regimes_and_varlen(kda, regime, cu, fused):
    """Weak and zero decay keep the carried state (and the segments' merge) most of the output."""
    gen = torch.Generator().manual_seed(13 + GATE_REGIMES.index(regime) + (0 if cu is None else len(cu)) + 5 * kda)
    T = 4100 if cu is None else cu[-1]
    run_and_check(fused, 1, T, 4 if cu is None or len(cu) < 10 else 2, gen, True, cu_seqlens=cu, regime=regime,
                  kda=kda)


@requires_sm100
@OPS
def test_dtypes_scale_l2norm(kda, fused):
    gen = torch.Generator().manual_seed(3 + kda)
    run_and_check(fused, 2, 300, 2, gen, True, dtype=torch.float16, beta_dtype=torch.float32, regime="weak", kda=kda)
    run_and_check(fused, 1, 300, 4, gen, True, regime="weak", scale=0.3, final=False, kda=kda)
    run_and_check(fused, 1, 1000, 4, gen, False, regime="mixed", l2norm=True, kda=kda)


@requires_sm100
@pytest.mark.parametrize("g_fill", [-5.0, -5.3, -8.0])
def test_kda_anchor_paths(g_fill, fused):
    """A constant per-step decay: -5 (FLA's lower bound) keeps every 16-row block within the anchor limit (the
    banded products), -5.3 and -8 pass it (the exact diagonal blocks); all must be right."""
    run_and_check(fused, 1, 300, 2, torch.Generator().manual_seed(6), True, kda=True, g_fill=g_fill)


@requires_sm100
def test_two_phase_is_refused_by_name():
    from inputs import make_inputs

    q, k, v, g, beta = make_inputs(1, 64, 2, torch.Generator().manual_seed(0), torch.device("cuda"))
    with pytest.raises(ValueError, match="SM100 has the fused path only"):
        la.forward(q, k, v, g, beta, None, None, False, None, False, None, None, kda=False,
                   options=PlanOptions(path="two_phase"))
