"""Executable spec of how the KDA kernels form the intra-chunk matrices without overflow.

For per-channel decay the chunk products need exp(G_rd - G_id) inside the channel sum:

    Akk[r, i] = b_r sum_d k_rd k_id exp(G_rd - G_id)   (i < r)      Aqk[r, i] = s sum_d q_rd k_id exp(G_rd - G_id)   (i <= r)

with G the inclusive cumulative log decay inside the chunk (G <= 0, non-increasing). The kernels split the
chunk into 16-row blocks and take one of two paths per chunk:

Fast path (every 16-row block decays by at most 2^ANCHOR_LIMIT_LOG2 in every channel, i.e. G[b] - G[b + 15] <=
112 ln 2 = 77.6; FLA's lower bound g >= -5 gives at most 75): one product per column block q, anchored at its
FIRST row a, covering its diagonal block and every row below:
[x_r exp(G_r - G_a)]_{r >= a} @ [k_i exp(G_a - G_i)]_{i in block q}^T. The left factor is <= 1, the right one
<= 2^112 (finite in fp32 and bf16), and their product is exp(G_r - G_i) <= 1 for i <= r.

Exact path (otherwise), where no positive number is exponentiated:
- below the diagonal blocks (row block p > column block q): anchor at e = the last row of block q, so
  exp(G_r - G_i) = exp(G_r - G_e) exp(G_e - G_i) with both factors <= 1 (r > e >= i). One product per column
  block: [x_r exp(G_r - G_e)]_{r in blocks > q} @ [k_i exp(G_e - G_i)]_{i in block q}^T (a 64 x 16 x K product).
- the 16 x 16 diagonal blocks: exact pairwise sums with exp(G_rd - G_id) <= 1 (i <= r).
So any g <= 0 is accepted (no lower-bound contract); chunks past the limit only run slower.

Row-anchored fast form (`form="rows"`, the SM90 phase-1 kernel's): under the same limit, every row is anchored at
the first row a(r) of its OWN 16-row block: left factors x_r exp(G_r - G_a(r)) (<= 1), R0_i = k_i exp(G_a(i) - G_i)
(<= 2^112, fp32); block (p, q), p = q + delta, uses the right factor R0_i c_pq, c_pq = exp(G_a(p) - G_a(q)) <= 1:
one right matrix and one full-height product per delta, of which block band delta is kept.
`intra_chunk_blocked` computes the two matrices the kernels' way, with operands rounded to `operand_dtype` as
the tensor-core products see them and fp32 accumulation.
"""

from __future__ import annotations

import torch

BLOCK = 16
# The fast path's bound on a right factor, log2 units (the SM90 kernel reads this constant).
ANCHOR_LIMIT_LOG2 = 112.0


def uses_fast_path(g, block=BLOCK) -> bool:
    """True if no 16-row block of this chunk decays by more than 2^ANCHOR_LIMIT_LOG2 in any channel."""
    G = torch.cumsum(g.double(), dim=0) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    C = G.shape[0]
    spans = [(G[b] - G[min(b + block, C) - 1]).max().item() for b in range(0, C, block)]
    return max(spans) <= ANCHOR_LIMIT_LOG2


def intra_chunk_blocked(q, k, g, beta, scale, operand_dtype=torch.bfloat16, block=BLOCK, form="columns"):
    """Akk (strictly lower, beta on rows) and Aqk (lower, scaled) for one chunk and head, the kernels' way.

    q, k [C, K]; g [C, K] per-step log decay (<= 0); beta [C]. Returns fp32 (Akk, Aqk) [C, C]. `form`: the fast
    path's factorization, "columns" (column-block anchors) or "rows" (row-block anchors, see the module doc).
    """
    if form not in ("columns", "rows"):
        raise ValueError(f"form must be 'columns' or 'rows', got {form!r}")
    C, K = k.shape
    G = torch.cumsum(g.float(), dim=0)
    qf, kf = q.float(), k.float()
    rnd = lambda t: t.to(operand_dtype).float()
    Akk = torch.zeros(C, C)
    Aqk = torch.zeros(C, C)
    if uses_fast_path(g, block) and form == "rows":
        nb = (C + block - 1) // block
        anchor = (torch.arange(C) // block) * block               # a(r): first row of r's block
        left_k = rnd(kf * torch.exp(G - G[anchor]))               # <= 1
        left_q = rnd(qf * torch.exp(G - G[anchor]))
        r0 = kf * torch.exp(G[anchor] - G)                        # <= 2^112, fp32
        for delta in range(nb):
            ncols = min((nb - delta) * block, C)
            c = torch.stack([torch.exp(G[(i // block + delta) * block] - G[(i // block) * block])
                             for i in range(ncols)])              # c_{q + delta, q} per column row, <= 1
            right = rnd(r0[:ncols] * c)
            pk, pq = left_k @ right.T, left_q @ right.T           # [C, ncols]; band delta is kept
            for cb in range(nb - delta):
                rows = slice((cb + delta) * block, min((cb + delta + 1) * block, C))
                cols = slice(cb * block, min((cb + 1) * block, C))
                Akk[rows, cols] = pk[rows, cols]
                Aqk[rows, cols] = pq[rows, cols]
        return torch.tril(Akk, -1) * beta.float()[:, None], torch.tril(Aqk) * scale
    if uses_fast_path(g, block):
        for a in range(0, C, block):
            cols = slice(a, min(a + block, C))
            right = rnd(kf[cols] * torch.exp(G[a] - G[cols]))        # <= 2^112
            left_k = rnd(kf[a:] * torch.exp(G[a:] - G[a]))           # <= 1
            left_q = rnd(qf[a:] * torch.exp(G[a:] - G[a]))
            Akk[a:, cols] = left_k @ right.T
            Aqk[a:, cols] = left_q @ right.T
        return torch.tril(Akk, -1) * beta.float()[:, None], torch.tril(Aqk) * scale
    for qb in range(0, C, block):
        e = min(qb + block, C) - 1                      # anchor: last row of column block qb
        rows = slice(qb + block, C)                     # row blocks below it
        if rows.start >= C:
            continue
        right = rnd(kf[qb : e + 1] * torch.exp(G[e] - G[qb : e + 1]))          # <= 1
        left_k = rnd(kf[rows] * torch.exp(G[rows] - G[e]))                     # <= 1
        left_q = rnd(qf[rows] * torch.exp(G[rows] - G[e]))
        Akk[rows, qb : e + 1] = left_k @ right.T
        Aqk[rows, qb : e + 1] = left_q @ right.T
    for pb in range(0, C, block):
        pe = min(pb + block, C)
        for r in range(pb, pe):
            d = torch.exp(G[r] - G[pb : r + 1])                                  # <= 1
            Akk[r, pb : r] = (kf[r] * kf[pb:r] * d[:-1]).sum(-1)
            Aqk[r, pb : r + 1] = (qf[r] * kf[pb : r + 1] * d).sum(-1)
    Akk = torch.tril(Akk, -1) * beta.float()[:, None]
    Aqk = torch.tril(Aqk) * scale
    return Akk, Aqk


def intra_chunk_exact(q, k, g, beta, scale):
    """The same matrices straight from the definition, in float64."""
    G = torch.cumsum(g.double(), dim=0)
    qd, kd = q.double(), k.double()
    D = torch.exp((G[:, None, :] - G[None, :, :]).clamp(max=0))  # only i <= r is kept
    Akk = torch.tril(torch.einsum("rd,id,rid->ri", kd, kd, D), -1) * beta.double()[:, None]
    Aqk = torch.tril(torch.einsum("rd,id,rid->ri", qd, kd, D)) * scale
    return Akk, Aqk
