"""Executable spec of the SM90 kernels' in-chunk solve: X = (I + A)^-1 for a strictly lower-triangular A [C, C]
(C = 64), in 16 x 16 blocks, in exactly the kernel's order and storage.

Storage: one C x C buffer holds A in its strictly lower part; X's strictly lower part is written transposed
into the (unused) upper part, so A stays readable while X is built. X has a unit diagonal.
- Level 0, one column c of each diagonal block b (64 threads): right-looking substitution. x starts as e_c; once
  x_i is final, every later row r takes x_r -= A[r, i] x_i (independent updates, a 16-step critical path).
  Rows above c stay 0 by construction.
- Level d = 1..3, block p = q + d (one element (rr, cc) per thread and block):
  Y = sum_{kb=q}^{p-1} A_{p,kb} X_{kb,q}, then X_{p,q} = -X_{p,p} Y, with the sums split into 4 partial sums
  by term index mod 4 (shorter dependency chains).
`blocked_unit_lower_inverse` follows those steps on a torch buffer (vectorized over the threads of a step).
"""

from __future__ import annotations

import torch

BLOCK = 16


def blocked_unit_lower_inverse(A: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """(I + A)^-1 for strictly lower A [C, C] (C a multiple of `block`), computed the kernels' way."""
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
    X = lambda p, q: _x_block(buf, p, q, block)
    for d in range(1, nb):
        Ys = {}
        for q in range(nb - d):
            p = q + d
            parts = torch.zeros((4, block, block), dtype=A.dtype)
            terms = [(buf[p * block:(p + 1) * block, kb * block:(kb + 1) * block], X(kb, q)) for kb in range(q, p)]
            t = 0
            for a_blk, x_blk in terms:
                for s_ in range(block):
                    parts[t % 4] += a_blk[:, s_:s_ + 1] * x_blk[s_:s_ + 1, :]
                    t += 1
            Ys[q] = (parts[0] + parts[1]) + (parts[2] + parts[3])
        for q, Y in Ys.items():
            p = q + d
            parts = torch.zeros((4, block, block), dtype=A.dtype)
            xpp = X(p, p)
            for s_ in range(block):
                off = torch.where(torch.arange(block)[:, None] > s_, xpp[:, s_:s_ + 1], torch.zeros(()))
                parts[s_ % 4] += off * Y[s_:s_ + 1, :]
            Xpq = -Y - ((parts[0] + parts[1]) + (parts[2] + parts[3]))
            buf[q * block:(q + 1) * block, p * block:(p + 1) * block] = Xpq.T
    return torch.eye(C, dtype=A.dtype) + torch.triu(buf, 1).T


def _x_block(buf, p, q, block):
    """Block (p, q) of X from the buffer: unit diagonal, strictly lower part stored transposed."""
    if p < q:
        return torch.zeros((block, block), dtype=buf.dtype)
    sub = buf[q * block:(q + 1) * block, p * block:(p + 1) * block].T
    if p == q:
        return torch.eye(block, dtype=buf.dtype) + torch.tril(sub, -1)
    return sub
