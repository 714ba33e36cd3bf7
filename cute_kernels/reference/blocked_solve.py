"""Executable spec of the SM90 kernels' in-chunk solve: X = (I + A)^-1 for a strictly lower-triangular A [C, C]
(C = 64), in the kernel's order and storage.

Storage: one C x C buffer holds A in its strictly lower part; X's strictly lower part is written transposed
into the (unused) upper part, so A stays readable while X is built. X has a unit diagonal.
- Level 0, one column c of each 16 x 16 diagonal block b (64 threads): right-looking substitution. x starts as
  e_c; once x_i is final, every later row r takes x_r -= A[r, i] x_i. Rows above c stay 0 by construction.
- Doubling levels h = 16, 32: each diagonal block of size 2 h is [[X_00, 0], [X_10, X_11]] with X_00, X_11 the
  inverses of its h-blocks (already built) and X_10 = -X_11 A_10 X_00, in two phases:
  Y = A_10 X_00, then X_10 = -(Y + X_11^strict Y).
`blocked_unit_lower_inverse` follows those steps on a torch buffer (vectorized over the threads of a step). With
`operand="fp16"` it is the SM90 kernels' levels (`ChunkMath.solve_levels_f16`: fp16 operands, Y rounded to fp16
only as the second product's operand), with `operand="tf32"` SM100's (`solve_levels_mma`: tf32 operands rounded
to nearest, warp-level mma.sync since CuTe DSL has no tf32 wgmma op); both keep X_11's unit diagonal in fp32.
`operand="fp32"` is the exact-arithmetic form of the same steps (each sum in 4 partial sums by term index mod 4).
`product_unit_lower_inverse` and `series_block_inverse` are alternative tensor-core forms, for accuracy tests.
"""

from __future__ import annotations

import torch

BLOCK = 16


def _parts_sum(terms) -> torch.Tensor:
    """sum of `terms` (a list of equal-shape tensors, in order) with 4 partial sums by index mod 4."""
    parts = [torch.zeros_like(terms[0]) for _ in range(4)]
    for t, x in enumerate(terms):
        parts[t % 4] = parts[t % 4] + x
    return (parts[0] + parts[1]) + (parts[2] + parts[3])


def blocked_unit_lower_inverse(A: torch.Tensor, block: int = BLOCK, operand: str = "fp32") -> torch.Tensor:
    """(I + A)^-1 for strictly lower A [C, C] (C = block times a power of two), computed the kernels' way.

    `operand` "fp32": the levels in fp32 (4-way partial sums, in order). Otherwise the tensor-core levels
    ("fp16": SM90's `solve_levels_f16`; "tf32": SM100's `solve_levels_mma`): Y = A_10 X_00 and Z = X_11^strict Y
    on `round_operand(., operand)` inputs with fp32 accumulation, X_10 = -(Y + Z) (the unit diagonal of X_11 in
    fp32; the order of the tensor cores' sums is not modelled)."""
    C = A.shape[0]
    nb = C // block
    buf = torch.tril(A, -1).clone()
    # Level 0: per diagonal block, all columns at once (column c of block b is one kernel thread).
    for b in range(nb):
        s = slice(b * block, (b + 1) * block)
        Ab = buf[s, s]
        x = torch.eye(block, dtype=A.dtype)                      # x[:, c] is thread c's vector
        for i in range(block):
            x[i + 1:, :] -= Ab[i + 1:, i:i + 1] * x[i:i + 1, :]
        buf[s, s] = buf[s, s] + torch.triu(x.T, 1)                # X^T above the diagonal
    h = block
    while h < C:
        for b0 in range(0, C, 2 * h):
            b1 = b0 + h
            x00 = _x_block(buf, b0, h)
            x11 = torch.tril(_x_block(buf, b1, h), -1)
            a10 = buf[b1:b1 + h, b0:b0 + h]
            if operand == "fp32":
                Y = _parts_sum([a10[:, s_:s_ + 1] * x00[s_:s_ + 1, :] for s_ in range(h)])
                X10 = -Y - _parts_sum([x11[:, s_:s_ + 1] * Y[s_:s_ + 1, :] for s_ in range(h)])
            else:
                Y = round_operand(a10, operand) @ round_operand(x00, operand)
                X10 = -(Y + round_operand(x11, operand) @ round_operand(Y, operand))
            buf[b0:b0 + h, b1:b1 + h] = X10.T
        h *= 2
    return torch.eye(C, dtype=A.dtype) + torch.triu(buf, 1).T


def _x_block(buf, b0, h):
    """The diagonal block of X at [b0, b0 + h) (unit diagonal, strictly lower part stored transposed)."""
    sub = buf[b0:b0 + h, b0:b0 + h].T
    return torch.eye(h, dtype=buf.dtype) + torch.tril(sub, -1)


def round_operand(x: torch.Tensor, operand: str) -> torch.Tensor:
    """x (fp32) as a tensor-core input of type `operand`, back in fp32: "fp32" (unchanged), "tf32" (10 mantissa
    bits, round to nearest, ties away: cvt.rna.tf32.f32), "tf32-trunc" (the low 13 bits dropped), "bf16", "fp16"
    (round to nearest even: cvt.rn.f16.f32)."""
    x = x.float()
    if operand == "fp32":
        return x
    if operand == "bf16":
        return x.bfloat16().float()
    if operand == "fp16":
        return x.half().float()
    bits = x.contiguous().view(torch.int32)
    if operand == "tf32":
        bits = bits + 0x1000   # half an ulp of the 10-bit mantissa: ties round away from zero
    elif operand != "tf32-trunc":
        raise ValueError(f"operand must be fp32, tf32, tf32-trunc, bf16 or fp16, got {operand!r}")
    return (bits & ~0x1FFF).view(torch.float32)


def product_unit_lower_inverse(A: torch.Tensor, operand: str = "tf32", block: int = BLOCK) -> torch.Tensor:
    """(I + A)^-1 for strictly lower A [C, C] (fp32 result): level 0 as `blocked_unit_lower_inverse`, then each
    doubling level's X_10 = -X_11 (A_10 X_00) as two products on `round_operand(., operand)` inputs with fp32
    accumulation (the tensor-core form)."""
    C = A.shape[0]
    X = blocked_unit_lower_inverse(A.float(), block)   # its diagonal blocks of size `block` are level 0's
    A = torch.tril(A.float(), -1)
    keep = torch.zeros(C, C, dtype=torch.bool)
    for b in range(0, C, block):
        keep[b:b + block, b:b + block] = True
    X = torch.where(keep, X, torch.zeros_like(X))
    h = block
    while h < C:
        for b0 in range(0, C, 2 * h):
            b1 = b0 + h
            x00, x11 = X[b0:b0 + h, b0:b0 + h], X[b1:b1 + h, b1:b1 + h]
            Y = round_operand(A[b1:b1 + h, b0:b0 + h], operand) @ round_operand(x00, operand)
            X[b1:b1 + h, b0:b0 + h] = -(round_operand(x11, operand) @ round_operand(Y, operand))
        h *= 2
    return X


def series_block_inverse(A: torch.Tensor, operand: str = "tf32", block: int = BLOCK) -> torch.Tensor:
    """The diagonal blocks of (I + A)^-1 (zeros elsewhere) for strictly lower A [C, C], each as the product
    (I - a)(I + a^2)(I + a^4)(I + a^8) of its block a (exact for block <= 16: a is nilpotent), every product on
    `round_operand(., operand)` inputs with fp32 accumulation: a tensor-core form of level 0 (too coarse in tf32)."""
    assert block <= 16, "the series stops at a^8: blocks of at most 16 rows"
    C = A.shape[0]
    A = torch.tril(A.float(), -1)
    X = torch.zeros(C, C)
    eye = torch.eye(block)
    r = lambda x: round_operand(x, operand)   # noqa: E731
    for b in range(0, C, block):
        a = A[b:b + block, b:b + block]
        a2 = r(a) @ r(a)
        a4 = r(a2) @ r(a2)
        a8 = r(a4) @ r(a4)
        P = r(eye - a) @ r(eye + a2)
        P = r(P) @ r(eye + a4)
        X[b:b + block, b:b + block] = r(P) @ r(eye + a8)
    return X
