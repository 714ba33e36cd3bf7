"""The peers of the chunked GDN / KDA forward, each behind one adapter, for `benchmarks.sweep --peers`.

A `Peer` takes our inputs (`ops.make_inputs`: q, k, v [B, T, H, 128], g log-space fp32, beta) and
    * `prepare`s them into its own convention once per input set (outside the timing: layouts, g in linear space,
      dtypes),
    * `call`s its function on them (the timed part),
    * turns its `outputs` back into ours (o [B, T, H, V], final state [N, H, K, V] fp32) for the error check.

Peers:
    fla         FLA 0.6.0's Triton `chunk_gated_delta_rule` / `chunk_kda` (our inputs as they are).
    flashinfer  FlashInfer 0.7.2.post1's CuTe DSL `chunk_gated_delta_rule` (GDN; packed varlen layout, g as
                alpha = exp(g), beta fp32, state [N, H, V, K]; its own `use_cp="auto"` intra-card context
                parallelism). It has no SM90 chunked KDA: its KDA prefill backends are SM100 / SM103 / SM120.
    flashqla    FlashQLA 0.1.3 (TileLang) `chunk_gated_delta_rule` (GDN; FLA's conventions). It pins
                apache-tvm-ffi < 0.1.13, so it is installed in a folder of its own and timed in its own process
                (`--no-ours --peers flashqla`, then `python -m benchmarks.combine --merge-peers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from benchmarks.ops import GATE_LOWER_BOUND

FLA_VERSION = "0.6.0"
PEERS = ("fla", "flashinfer", "flashqla")


class PeerUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Peer:
    name: str
    label: str
    prepare: Callable[[dict], Any]
    call: Callable[[Any], Any]
    outputs: Callable[[Any, Any], tuple]


def _same(x):
    return x


def _as_is(result, prepared):
    return result


def fla_peer(op: str, *, fla_safe_gate: bool = False) -> Peer:
    try:
        import fla

        if op == "kda":
            from fla.ops.kda import chunk_kda as fn
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    except Exception as e:
        raise PeerUnavailable(
            f"FLA (flash-linear-attention=={FLA_VERSION}) cannot be imported: {type(e).__name__}: {e}; install "
            f"it, e.g. pip install .wheelhouse/dl/fla_core-{FLA_VERSION}-py3-none-any.whl "
            f".wheelhouse/dl/flash_linear_attention-{FLA_VERSION}-py3-none-any.whl") from e
    extra = {"safe_gate": True, "lower_bound": GATE_LOWER_BOUND} if op == "kda" and fla_safe_gate else {}

    def call(x):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=None, initial_state=None,
                  output_final_state=True, cu_seqlens=None, **extra)

    label = f"fla {getattr(fla, '__version__', '?')} {fn.__name__}" + (" safe_gate" if extra else "")
    return Peer("fla", label, _same, call, _as_is)


def flashinfer_prepare(x: dict) -> dict:
    """Our inputs in FlashInfer's GDN convention: [B*T, H, D] rows, cu_seqlens int32, g as alpha = exp(g)
    [B*T, H] fp32, beta [B*T, H] fp32."""
    B, T = x["q"].shape[:2]

    def rows(t):
        return t.reshape(B * T, *t.shape[2:]).contiguous()

    return {"q": rows(x["q"]), "k": rows(x["k"]), "v": rows(x["v"]), "g": rows(x["g"]).float().exp(),
            "beta": rows(x["beta"]).float(), "cu_seqlens": torch.arange(0, (B + 1) * T, T, dtype=torch.int32,
                                                                        device=x["q"].device), "B": B, "T": T}


def flashinfer_outputs(result, prepared: dict) -> tuple:
    """FlashInfer's (o [B*T, H, V], state [N, H, V, K]) as ours: o [B, T, H, V], state [N, H, K, V]."""
    o, state = result
    return o.view(prepared["B"], prepared["T"], *o.shape[1:]), state.transpose(-1, -2)


def flashinfer_peer(op: str) -> Peer:
    if op == "kda":
        raise PeerUnavailable("FlashInfer 0.7.2.post1 has no SM90 chunked KDA (its KDA prefill backends are "
                              "SM100 / SM103 / SM120 only)")
    try:
        import flashinfer
        fn = flashinfer.chunk_gated_delta_rule
    except Exception as e:
        raise PeerUnavailable(f"flashinfer cannot be imported: {type(e).__name__}: {e} (scripts/peer_wheels.sh "
                              "brings its wheel to the GPU machine)") from e

    def call(p):
        return fn(p["q"], p["k"], p["v"], g=p["g"], beta=p["beta"], scale=None, initial_state=None,
                  output_final_state=True, cu_seqlens=p["cu_seqlens"], max_seqlen=p["T"])

    return Peer("flashinfer", f"flashinfer {flashinfer.__version__} chunk_gated_delta_rule (use_cp=auto)",
                flashinfer_prepare, call, flashinfer_outputs)


def flashqla_peer(op: str) -> Peer:
    if op == "kda":
        raise PeerUnavailable("FlashQLA 0.1.3 has no KDA")
    try:
        import flash_qla
        fn = flash_qla.chunk_gated_delta_rule
    except Exception as e:
        raise PeerUnavailable(f"flash_qla cannot be imported: {type(e).__name__}: {e} (it needs a GPU at import, "
                              "and tilelang with apache-tvm-ffi < 0.1.13 in a folder of its own)") from e

    def call(x):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=None, initial_state=None,
                  output_final_state=True, cu_seqlens=None)

    return Peer("flashqla", f"flashqla {getattr(flash_qla, '__version__', '?')} chunk_gated_delta_rule", _same, call,
                _as_is)


def load_peers(op: str, names, *, fla_safe_gate: bool = False) -> tuple[dict[str, Peer], dict[str, str]]:
    """({name: Peer} of the `names` that load, {name: why not} of the others)."""
    loaders = {"fla": lambda: fla_peer(op, fla_safe_gate=fla_safe_gate), "flashinfer": lambda: flashinfer_peer(op),
               "flashqla": lambda: flashqla_peer(op)}
    peers, missing = {}, {}
    for name in names:
        if name not in loaders:
            raise ValueError(f"--peers: unknown peer {name!r}; choose from {', '.join(PEERS)}")
        try:
            peers[name] = loaders[name]()
        except PeerUnavailable as e:
            missing[name] = str(e)
    return peers, missing
