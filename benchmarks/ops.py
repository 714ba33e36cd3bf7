"""Input builders and callables for the benchmarked ops.

Each op has
    * ``make_inputs(op, B, H, T, dtype, device)`` -> dict of fresh random tensors,
    * an "ours" callable from ``cute_kernels`` (may be missing: :func:`load_ours` returns None),
    * the peers (FLA, FlashInfer, FlashQLA): `benchmarks.peers`.

(Decode attention has its own sweep, with several peers: `benchmarks/decode.py`.)

Both sides get exactly the same tensors and arguments.  Input choices:
    * q and k are L2-normalised per token outside the kernels (no ``use_qk_l2norm_in_kernel``).
    * g is the per-step log decay ``logsigmoid(randn)`` clamped to [-5, 0), in fp32.  FLA is called
      with its default ``safe_gate=False`` (no range contract); ``--fla-safe-gate`` switches FLA
      to ``safe_gate=True, lower_bound=-5``, whose contract (gates in [-5, 0)) these inputs meet.
    * beta = sigmoid(randn) in (0, 1), in the io dtype.
    * output_final_state=True on both sides, no initial state.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.roofline import HEAD_DIM

OPS = ("kda", "gdn")
OURS_ATTR = {"kda": "chunk_kda", "gdn": "chunk_gated_delta_rule"}
GATE_LOWER_BOUND = -5.0

# Exceptions meaning "ours is not available for this cell" rather than "ours is broken".
NOT_AVAILABLE = (NotImplementedError, ImportError)


def make_inputs(op: str, B: int, H: int, T: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Fresh random inputs for one call of ``op`` on cell (B, H, T)."""
    D = HEAD_DIM
    if op in ("kda", "gdn"):
        q = F.normalize(torch.randn(B, T, H, D, device=device, dtype=torch.float32), dim=-1).to(dtype)
        k = F.normalize(torch.randn(B, T, H, D, device=device, dtype=torch.float32), dim=-1).to(dtype)
        v = torch.randn(B, T, H, D, device=device, dtype=dtype)
        g_shape = (B, T, H, D) if op == "kda" else (B, T, H)
        g = F.logsigmoid(torch.randn(g_shape, device=device, dtype=torch.float32)).clamp_(min=GATE_LOWER_BOUND)
        beta = torch.sigmoid(torch.randn(B, T, H, device=device, dtype=torch.float32)).to(dtype)
        return {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    raise ValueError(f"unknown op {op!r}")


def inputs_nbytes(inputs: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in inputs.values())


# --------------------------------------------------------------------------- ours


def load_ours(op: str) -> tuple[Callable | None, str]:
    """The ``cute_kernels`` function for ``op``, or (None, why) when it does not exist."""
    try:
        import cute_kernels
    except ImportError as e:
        return None, f"cute_kernels not importable: {e}"
    fn = getattr(cute_kernels, OURS_ATTR[op], None)
    if fn is None:
        return None, f"cute_kernels.{OURS_ATTR[op]} does not exist"
    return fn, ""


def call_ours(op: str, fn: Callable, x: dict[str, torch.Tensor]) -> Any:
    return fn(
        x["q"], x["k"], x["v"], x["g"], x["beta"],
        scale=None, initial_state=None, output_final_state=True, cu_seqlens=None,
    )


def last_plan() -> Any:
    """``cute_kernels.last_plan()`` if the package has it (the scheduler's explanation), else None."""
    try:
        import cute_kernels

        fn = getattr(cute_kernels, "last_plan", None)
        return fn() if fn is not None else None
    except Exception as e:  # the plan is optional; never let it break a run
        return f"last_plan() failed: {e!r}"


# --------------------------------------------------------------------------- correctness


def output_tensors(result: Any) -> list[torch.Tensor | None]:
    """The output tensors of a call: (o, final_state)."""
    if isinstance(result, torch.Tensor):
        return [result]
    return [t if isinstance(t, torch.Tensor) else None for t in result]


def max_rel_err(ours: Any, peer: Any) -> float:
    """max over outputs of ||ours - peer|| / ||peer|| (Frobenius norms, in fp32).

    Outputs compared: o, plus the final state when both sides return one.  A shape mismatch
    counts as an infinite error.
    """
    worst = 0.0
    for a, b in zip(output_tensors(ours), output_tensors(peer)):
        if a is None or b is None:
            continue
        if a.numel() != b.numel():
            return float("inf")
        a = a.reshape(b.shape).float()
        b = b.float()
        err = (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30)).item()
        if err != err:  # NaN in either output
            return float("inf")
        worst = max(worst, err)
    return worst
