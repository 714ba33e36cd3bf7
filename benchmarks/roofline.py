"""Roofline floor per benchmark cell.

The floor is the time a perfect kernel would need on the device:

    floor = max(bytes / bandwidth, flops / tensor_throughput)

* bytes: every input read once and every output written once (``numel * element_size`` summed).
* flops: the matmul work of the chunked algorithm (see :func:`chunk_flops`) or of decode attention.

The bandwidth ceiling is the copy bandwidth measured on the card (:func:`copy_bw_tbs`: H100 3.0 TB/s, H200
4.2); both ceilings can be overridden from the CLI (``--bw-tbs`` in TB/s, ``--tflops`` in TFLOP/s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: HBM bandwidth ceiling, bytes per second (H200: 4.8 TB/s peak, ~4.2 reachable).
BW_BYTES_PER_S = 4.2e12
#: Measured copy bandwidth per card (TB/s); a card not listed takes the H200's.
COPY_TBS = {"H100": 3.0, "H200": 4.2}


def copy_bw_tbs(device_name: str) -> float:
    """The bandwidth ceiling of the card named `device_name` (TB/s)."""
    return next((bw for card, bw in COPY_TBS.items() if card in device_name), BW_BYTES_PER_S / 1e12)
#: Dense bf16 tensor-core ceiling, FLOP per second.
TENSOR_FLOPS_PER_S = 729e12

#: Chunk length of the chunked KDA / gated-delta-rule algorithm.
CHUNK = 64
#: Head dimension used by every op (K = V = D = 128).
HEAD_DIM = 128
#: Query heads per KV head in the decode benchmark (GQA).
GQA_RATIO = 8

FP32 = 4


@dataclass(frozen=True)
class Ceilings:
    """The two roofline ceilings: bytes/s and FLOP/s."""

    bytes_per_s: float = BW_BYTES_PER_S
    flops_per_s: float = TENSOR_FLOPS_PER_S

    @classmethod
    def from_cli(cls, bw_tbs: float, tflops: float) -> "Ceilings":
        """From the CLI units: TB/s and TFLOP/s."""
        return cls(bytes_per_s=bw_tbs * 1e12, flops_per_s=tflops * 1e12)

    def as_dict(self) -> dict:
        return {"bytes_per_s": self.bytes_per_s, "flops_per_s": self.flops_per_s}


@dataclass(frozen=True)
class Cost:
    """Bytes moved and FLOPs done by one call of an op on one cell."""

    bytes: int
    flops: int


def chunk_flops(C: int = CHUNK, K: int = HEAD_DIM, V: int = HEAD_DIM) -> int:
    """FLOPs of one chunk of C tokens for one (sequence, head) of chunked KDA / GDN.

    Terms (a matmul of [m, k] x [k, n] counts 2*m*k*n):
        2*C*C*K      k k^T          (intra-chunk key Gram matrix)
        2*C*C*K      q k^T          (intra-chunk attention scores)
        2*C*C*K      w = T kg       (WY representation, keys)
        2*C*C*V      u = T v        (WY representation, values)
        2*C*C*V      tril(Aqk) v_new (intra-chunk output)
        3*2*C*K*V    w S, q S, kg^T v_new (state read twice, state update once)
        C^3          the triangular solve for T
    """
    return 3 * 2 * C * C * K + 2 * 2 * C * C * V + 3 * 2 * C * K * V + C**3


def linear_attention_cost(
    B: int,
    H: int,
    T: int,
    *,
    per_channel_gate: bool,
    io_bytes: int = 2,
    K: int = HEAD_DIM,
    V: int = HEAD_DIM,
    C: int = CHUNK,
) -> Cost:
    """Cost of chunked KDA (``per_channel_gate=True``) or gated delta rule (``False``).

    Reads q, k [B,T,H,K] and v [B,T,H,V] and beta [B,T,H] in the io dtype, g in fp32
    ([B,T,H,K] for KDA, [B,T,H] for GDN); writes o [B,T,H,V] in the io dtype and the fp32
    final state [B,H,K,V].  No initial state is read.
    """
    tokens = B * T * H
    gate = tokens * (K if per_channel_gate else 1) * FP32
    reads = tokens * (2 * K + V) * io_bytes + gate + tokens * io_bytes
    writes = tokens * V * io_bytes + B * H * K * V * FP32
    flops = B * H * math.ceil(T / C) * chunk_flops(C, K, V)
    return Cost(bytes=reads + writes, flops=flops)


def decode_cost(B: int, Hkv: int, Tkv: int, *, io_bytes: int = 2, D: int = HEAD_DIM, gqa: int = GQA_RATIO) -> Cost:
    """Cost of one decode-attention step: q [B,1,Hq,D], k and v [B,Tkv,Hkv,D], o [B,1,Hq,D].

    FLOPs = 4*B*Hq*Tkv*D (q k^T and p v, 2 FLOPs per multiply-add each).
    """
    Hq = gqa * Hkv
    q_and_o = 2 * B * Hq * D * io_bytes
    kv = 2 * B * Tkv * Hkv * D * io_bytes
    return Cost(bytes=q_and_o + kv, flops=4 * B * Hq * Tkv * D)


def cell_cost(op: str, B: int, H: int, T: int, io_bytes: int = 2) -> Cost:
    """Cost of ``op`` on cell (B, H, T); for decode H is Hkv and T is Tkv."""
    if op == "kda":
        return linear_attention_cost(B, H, T, per_channel_gate=True, io_bytes=io_bytes)
    if op == "gdn":
        return linear_attention_cost(B, H, T, per_channel_gate=False, io_bytes=io_bytes)
    if op == "decode":
        return decode_cost(B, H, T, io_bytes=io_bytes)
    raise ValueError(f"unknown op {op!r}")


def floor_us(cost: Cost, ceilings: Ceilings = Ceilings()) -> tuple[float, str]:
    """The roofline floor in microseconds and which ceiling binds ("memory" or "compute")."""
    mem_us = cost.bytes / ceilings.bytes_per_s * 1e6
    comp_us = cost.flops / ceilings.flops_per_s * 1e6
    return (mem_us, "memory") if mem_us >= comp_us else (comp_us, "compute")
