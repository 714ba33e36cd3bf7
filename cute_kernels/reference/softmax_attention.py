"""Pure-torch references for non-causal (decode) softmax attention with split-KV and the log-sum-exp merge.

Layout: q ``[B, Tq, Hq, D]``; k ``[B, Tkv, Hkv, D]``; v ``[B, Tkv, Hkv, Dv]``. GQA: ``Hq % Hkv == 0`` and query
head h reads kv head ``h // (Hq // Hkv)``. ``kv_lens [B]`` (optional) is the number of valid KV tokens of each batch
row; keys at positions ``>= kv_lens[b]`` are ignored. lse is the natural-log log-sum-exp of the scaled scores,
``[B, Tq, Hq]``. A row with no valid keys has output 0 and lse ``-inf``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["attention_ref", "decode_attention_ref", "split_kv_partials", "lse_merge"]


def _check_tensor(name: str, x, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")


def _check_qkv(q, k, v, compute_dtype) -> None:
    if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
        raise TypeError(f"compute_dtype must be a floating-point torch.dtype, got {compute_dtype!r}")
    _check_tensor("q", q, 4)
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    B, _, Hq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be [B, Tkv, Hkv, D] with B = {B}, D = {D}, got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v must be [B, Tkv, Hkv, Dv] = {tuple(k.shape[:3])} + (Dv,), got {tuple(v.shape)}")
    Hkv = k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"k/v heads must divide q heads (GQA), got Hq = {Hq}, Hkv = {Hkv}")


def _parse_kv_lens(kv_lens, B: int, Tkv: int, device) -> Optional[torch.Tensor]:
    if kv_lens is None:
        return None
    if isinstance(kv_lens, torch.Tensor):
        if kv_lens.is_floating_point() or kv_lens.is_complex() or kv_lens.dtype == torch.bool:
            raise TypeError(f"kv_lens must hold integers, got dtype {kv_lens.dtype}")
        lens = kv_lens
    else:
        lens = torch.as_tensor(list(kv_lens))
        if lens.is_floating_point() or lens.dtype == torch.bool:
            raise TypeError("kv_lens must hold integers")
    if tuple(lens.shape) != (B,):
        raise ValueError(f"kv_lens must be [B] = [{B}], got shape {tuple(lens.shape)}")
    if B > 0 and (int(lens.min()) < 0 or int(lens.max()) > Tkv):
        raise ValueError(f"kv_lens must lie in [0, Tkv = {Tkv}], got {lens.tolist()}")
    return lens.to(device=device, dtype=torch.int64)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: Optional[float] = None,
    kv_lens=None,
    compute_dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Non-causal softmax attention with GQA and optional per-row KV lengths.

    ``o[b, i, h] = sum_j softmax_j(scale q[b,i,h] . k[b,j,h_kv]) v[b,j,h_kv]`` over valid keys ``j < kv_lens[b]``,
    ``scale`` defaulting to ``D**-0.5``. Returns ``(o [B, Tq, Hq, Dv], lse [B, Tq, Hq])`` in ``compute_dtype``;
    a row with no valid keys gives ``o = 0`` and ``lse = -inf``.
    """
    _check_qkv(q, k, v, compute_dtype)
    B, Tq, Hq, D = q.shape
    Tkv, Hkv = k.shape[1], k.shape[2]
    if scale is None:
        scale = D**-0.5
    dev = q.device
    lens = _parse_kv_lens(kv_lens, B, Tkv, dev)
    qf = q.to(dev, compute_dtype)
    group = Hq // Hkv
    kf = k.to(dev, compute_dtype).repeat_interleave(group, dim=2)  # [B, Tkv, Hq, D]
    vf = v.to(dev, compute_dtype).repeat_interleave(group, dim=2)  # [B, Tkv, Hq, Dv]
    s = float(scale) * torch.einsum("bihd,bjhd->bhij", qf, kf)  # [B, Hq, Tq, Tkv]
    if lens is not None:
        valid = torch.arange(Tkv, device=dev)[None, :] < lens[:, None]  # [B, Tkv]
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    if Tkv == 0:
        lse = s.new_full((B, Hq, Tq), float("-inf"))
    else:
        lse = torch.logsumexp(s, dim=-1)  # -inf where a row has no valid key
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = (s - lse_safe[..., None]).exp()  # exp(-inf) = 0 for masked keys
    o = torch.einsum("bhij,bjhe->bihe", p, vf)
    return o, lse.transpose(1, 2).contiguous()


def _parse_split_bounds(split_bounds, Tkv: int) -> List[int]:
    if isinstance(split_bounds, torch.Tensor):
        if split_bounds.is_floating_point() or split_bounds.dtype == torch.bool or split_bounds.ndim != 1:
            raise TypeError("split_bounds must be a 1-D integer tensor or a sequence of ints")
        vals = [int(x) for x in split_bounds.tolist()]
    else:
        if isinstance(split_bounds, (str, bytes)) or not isinstance(split_bounds, Sequence):
            raise TypeError("split_bounds must be a 1-D integer tensor or a sequence of ints")
        vals = list(split_bounds)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
            raise TypeError(f"split_bounds must hold ints, got {vals!r}")
    if len(vals) < 2:
        raise ValueError(f"split_bounds must have at least 2 entries ([0, Tkv]), got {vals}")
    if vals[0] != 0 or vals[-1] != Tkv:
        raise ValueError(f"split_bounds must start at 0 and end at Tkv = {Tkv}, got {vals}")
    if any(b < a for a, b in zip(vals[:-1], vals[1:])):
        raise ValueError(f"split_bounds must be non-decreasing, got {vals}")
    return vals


def split_kv_partials(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_splits: Optional[int] = None,
    split_bounds=None,
    scale: Optional[float] = None,
    kv_lens=None,
    compute_dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-split attention over contiguous KV ranges (the partials a split-KV kernel writes).

    Give exactly one of ``num_splits`` (S near-equal ranges, bounds ``[s * Tkv // S]``; ranges may be empty when
    S > Tkv) or ``split_bounds`` (``[0, ..., Tkv]``, non-decreasing). For each split the output is normalized within
    the split and lse is its log-sum-exp; a split with no valid keys gives ``o = 0`` and ``lse = -inf``.

    Returns ``(o_partial [S, B, Tq, Hq, Dv], lse_partial [S, B, Tq, Hq])`` in ``compute_dtype``.
    """
    _check_qkv(q, k, v, compute_dtype)
    B, Tkv = k.shape[0], k.shape[1]
    if (num_splits is None) == (split_bounds is None):
        raise ValueError("give exactly one of num_splits and split_bounds")
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
            raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
        bounds = [(s * Tkv) // num_splits for s in range(num_splits + 1)]
    else:
        bounds = _parse_split_bounds(split_bounds, Tkv)
    lens = _parse_kv_lens(kv_lens, B, Tkv, q.device)
    if lens is None:
        lens = torch.full((B,), Tkv, dtype=torch.int64, device=q.device)
    os, lses = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        lens_s = (lens - a).clamp(0, b - a)
        o_s, lse_s = attention_ref(q, k[:, a:b], v[:, a:b], scale, lens_s, compute_dtype)
        os.append(o_s)
        lses.append(lse_s)
    return torch.stack(os), torch.stack(lses)


def lse_merge(
    o_partial: torch.Tensor,
    lse_partial: torch.Tensor,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge normalized partial outputs by their log-sum-exps (the spec of the GPU merge kernel).

    ``o_partial [S, ..., D]``, ``lse_partial [S, ...]``. With ``m = max_s lse_s`` and ``w_s = exp(lse_s - m)``::

        o = sum_s w_s o_s / sum_s w_s,    lse = m + log(sum_s w_s)

    Splits with ``lse = -inf`` get weight 0 (their o is ignored, even if it is not finite); if every split is
    ``-inf`` (or S == 0) the result is ``o = 0``, ``lse = -inf``, never NaN. Computes in the promoted dtype of the
    inputs (at least float32). Returns ``o`` in ``out_dtype`` (default ``o_partial.dtype``) and ``lse`` in the
    compute dtype.
    """
    for name, x in (("o_partial", o_partial), ("lse_partial", lse_partial)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor")
    if o_partial.ndim < 2 or tuple(o_partial.shape[:-1]) != tuple(lse_partial.shape):
        raise ValueError(
            f"o_partial must be [S, ..., D] and lse_partial [S, ...] with matching leading dims, got "
            f"{tuple(o_partial.shape)} and {tuple(lse_partial.shape)}"
        )
    if out_dtype is None:
        out_dtype = o_partial.dtype
    cdt = torch.promote_types(torch.promote_types(o_partial.dtype, lse_partial.dtype), torch.float32)
    o_p = o_partial.to(cdt)
    lse_p = lse_partial.to(cdt)
    if o_p.shape[0] == 0:
        o = o_p.new_zeros(o_p.shape[1:])
        lse = lse_p.new_full(lse_p.shape[1:], float("-inf"))
        return o.to(out_dtype), lse
    m = lse_p.amax(dim=0)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = (lse_p - m_safe).exp()  # 0 for -inf splits
    wsum = w.sum(dim=0)
    contrib = torch.where((w > 0)[..., None], w[..., None] * o_p, torch.zeros_like(o_p))
    o = contrib.sum(dim=0) / torch.where(wsum > 0, wsum, torch.ones_like(wsum))[..., None]
    lse = m_safe + wsum.log()  # log(0) = -inf when every split is empty
    return o.to(out_dtype), lse


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens,
    page_table: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a KV cache (the spec of `cute_kernels.decode_attention`).

    ``q [B, Hq, D]`` (one new token per row) or ``[B, Sq, Hq, D]`` (Sq new tokens, causal among themselves, the last
    at position ``cache_seqlens[b] - 1``: token i sees keys ``j <= cache_seqlens[b] - Sq + i``). The cache is
    contiguous ``[B, Tmax, Hkv, D]``, or paged ``[num_pages, page_size, Hkv, D]`` with ``page_table [B, max_pages]``
    (row b's token t in page ``page_table[b, t // page_size]``, slot ``t % page_size``). Scores are
    ``scale q . k`` (``scale`` default ``D**-0.5``), then ``softcap * tanh(s / softcap)`` if ``softcap`` is given.
    Returns ``(o, lse)`` shaped like q without / with its last dim (lse natural-log); a query with no visible key
    gives ``o = 0``, ``lse = -inf``.
    """
    single = q.ndim == 3
    qf = (q[:, None] if single else q).to(compute_dtype)
    B, Sq, Hq, D = qf.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    scale = D**-0.5 if scale is None else float(scale)
    lens = [int(x) for x in torch.as_tensor(cache_seqlens).tolist()]
    o = qf.new_zeros(B, Sq, Hq, v_cache.shape[3])
    lse = qf.new_full((B, Sq, Hq), float("-inf"))
    for b in range(B):
        L = lens[b]
        if page_table is None:
            k, v = k_cache[b, :L], v_cache[b, :L]
        else:
            pages = page_table[b, : -(-L // k_cache.shape[1])].long().to(k_cache.device)
            k = k_cache[pages].reshape(-1, Hkv, D)[:L]
            v = v_cache[pages].reshape(-1, Hkv, v_cache.shape[3])[:L]
        k = k.to(compute_dtype).repeat_interleave(group, dim=1)   # [L, Hq, D]
        v = v.to(compute_dtype).repeat_interleave(group, dim=1)
        s = scale * torch.einsum("ihd,jhd->hij", qf[b], k)       # [Hq, Sq, L]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        visible = torch.arange(L, device=s.device)[None, :] <= (L - Sq + torch.arange(Sq, device=s.device))[:, None]
        s = s.masked_fill(~visible[None], float("-inf"))
        if L == 0:
            continue
        m = torch.logsumexp(s, dim=-1)                             # [Hq, Sq], -inf where nothing is visible
        p = (s - torch.where(torch.isfinite(m), m, torch.zeros_like(m))[..., None]).exp()
        o[b] = torch.einsum("hij,jhe->ihe", p, v)
        lse[b] = m.transpose(0, 1)
    return (o[:, 0], lse[:, 0]) if single else (o, lse)
