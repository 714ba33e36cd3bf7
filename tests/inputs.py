"""Inputs for the op tests, with gate regimes that let a bug in the carried state show.

Strong random gates (about -0.8 per step) decay the state by ~e^-51 over a 64-token chunk: whatever a kernel
does to the state it carries across chunks or segments is then invisible at bf16 tolerances. Real GDN / KDA
layers keep long-memory heads with decays near 0, which is where the carry, the summaries' M and the merge
decide the output. Every op test family runs its cases in each regime:

- ``strong``: ``logsigmoid(randn)`` clamped at -5 (about -0.8 per step);
- ``moderate``: ``logsigmoid(randn + 2)`` (about -0.18 per step, e^-12 per chunk);
- ``weak``: uniform in [-0.02, 0];
- ``zero``: ``g = 0`` (no decay at all);
- ``mixed``: weak, with every other head (GDN) or every other key channel (KDA) strong.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GATE_REGIMES = ("strong", "weak", "zero", "mixed")
LONG_REGIMES = ("weak", "zero")   # the regimes every long case (T >= 4096, N >= 4 segments) must include


def gates(shape, regime: str, gen: torch.Generator) -> torch.Tensor:
    """Per-step log decays (fp32, <= 0) of `shape` = [B, T, H] (GDN) or [B, T, H, K] (KDA)."""
    x = torch.randn(shape, generator=gen)
    strong = F.logsigmoid(x).clamp(min=-5.0)
    if regime == "strong":
        return strong
    if regime == "moderate":
        return F.logsigmoid(x + 2.0)
    if regime == "zero":
        return torch.zeros(shape)
    weak = -0.02 * torch.rand(shape, generator=gen)
    if regime == "weak":
        return weak
    if regime == "mixed":
        axis = 3 if len(shape) == 4 else 2   # KDA: key channels; GDN: heads
        odd = (torch.arange(shape[axis]) % 2 == 1).view((-1,) + (1,) * (len(shape) - 1 - axis))
        return torch.where(odd, strong, weak)
    raise ValueError(f"unknown gate regime {regime!r}: one of {GATE_REGIMES + ('moderate',)}")


def make_inputs(B, T, H, gen, device="cpu", dtype=torch.bfloat16, *, kda=False, regime="strong", K=128, V=128,
                beta_dtype=None, normalize=True):
    """(q, k, v, g, beta): q, k L2-normalized (`normalize=False`: raw, for use_qk_l2norm_in_kernel), v standard
    normal, g in `regime` (fp32), beta = sigmoid(randn) in `beta_dtype` (default: `dtype`)."""
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if normalize:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = gates((B, T, H, K) if kda else (B, T, H), regime, gen)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    cast = lambda t: t.to(dtype).to(device)   # noqa: E731
    return cast(q), cast(k), cast(v), g.to(device), beta.to(beta_dtype or dtype).to(device)


def initial_state(N, H, gen, device="cpu", K=128, V=128, scale=0.1) -> torch.Tensor:
    """A random fp32 initial state [N, H, K, V]."""
    return (torch.randn(N, H, K, V, generator=gen) * scale).to(device)
