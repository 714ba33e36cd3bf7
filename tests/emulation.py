"""The kernels' contracts in float64 on the CPU, standing in for their compiled functions, so the ops' host
orchestration (plans, tile tables, argument order, views, the summary layout (h_ext, M), the merge wiring) is
tested without a GPU. `emulate(monkeypatch)` swaps them into the runners and makes the ops accept CPU tensors."""

from __future__ import annotations

import torch

from cute_kernels import reference as ref
from schedulers import TILE_FIELDS

COL = {f: i for i, f in enumerate(TILE_FIELDS)}


def rows(tiles, num_tiles):
    return [{f: row[i] for f, i in COL.items()} for row in tiles[:num_tiles].tolist()]


def gated(cfg, g, beta, a_log, dt_bias, lower_bound):
    """(g, beta) as the kernels read them under `cfg.gate` (FLA's gate arguments; the float64 spec's formulas)."""
    from cute_kernels.reference.recurrent_step import gate_values

    form = cfg.gate
    if form.g != "log":
        g = gate_values(g.double(), cfg.kda, a_log if form.a_log else None, dt_bias if form.dt_bias else None,
                        lower_bound if form.g == "bounded" else None).float()
    if form.beta != "value":
        beta = torch.sigmoid(beta.double()).float() * (2.0 if form.beta == "sigmoid2" else 1.0)
    return g, beta


class FusedEmulator:
    """One launch of `ChunkedForwardSm90` (`FusedConfig`), tile by tile, with the float64 chunked reference."""

    def __init__(self, config):
        self.config = config

    def fn(self, q, k, v, g, beta, a_log, dt_bias, lower_bound, o, s_in, s_out, tiles, num_tiles, grid, scale):
        cfg = self.config
        g, beta = gated(cfg, g, beta, a_log, dt_bias, lower_bound)
        # the kernel takes [B, T, ...] tensors and flattens B and T (they must be contiguous)
        assert all(t.is_contiguous() for t in (q, k, v, g, beta, o))
        q, k, v, g, beta, o = (t.flatten(0, 1) for t in (q, k, v, g, beta, o))
        K = k.shape[-1]
        for t in rows(tiles, num_tiles):
            h, a, b = t["head"], t["tok_start"], t["tok_end"]
            vv = v[a:b, h][None, :, None].double()
            if cfg.mode == "summary":
                s0 = torch.zeros(K, K, dtype=torch.float64) if t["block"] == 0 else torch.eye(K, dtype=torch.float64)
                if t["block"] == 1:
                    vv = torch.zeros_like(vv)
            elif cfg.mode == "segment_outputs":
                s0 = s_in[t["seg_slot"], h].double()
            else:
                s0 = s_in[t["seq"], h].double() if cfg.initial_state else torch.zeros(K, vv.shape[-1]).double()
            out, s_end = ref.chunk_gated_delta_rule_ref(
                q[a:b, h][None, :, None], k[a:b, h][None, :, None], vv, g[a:b, h][None, :, None],
                beta[a:b, h][None, :, None], scale=scale, initial_state=s0[None, None], output_final_state=True)
            if cfg.mode == "summary":
                s_out[t["block"] * (s_out.shape[0] // 2) + t["seg_slot"], h] = s_end[0, 0].float()
                continue
            o[a:b, h] = out[0, :, 0].to(o.dtype)
            if cfg.final_state and t["segment"] == t["num_segments"] - 1:
                s_out[t["seq"], h] = s_end[0, 0].float()


class MergeEmulator:
    """`AffineMerge`'s contract (`MergeConfig`): the float64 reference merge; the summaries the kernel never
    reads (the first M without an initial state; each sequence's last summary with `starts_only`) may hold the
    poison, so they are zeroed first -- any other unwritten slot still shows as NaN."""

    def __init__(self, config):
        self.config = config

    def fn(self, M, h_ext, offsets, initial_state, starts, final):
        cfg = self.config
        M, h_ext, offs = M.double().clone(), h_ext.double().clone(), [int(x) for x in offsets.tolist()]
        for n in range(len(offs) - 1):
            if offs[n + 1] > offs[n]:
                if not cfg.initial_state:
                    M[offs[n]] = 0
                if cfg.starts_only:
                    M[offs[n + 1] - 1] = 0
                    h_ext[offs[n + 1] - 1] = 0
        got_starts, got_final = ref.affine_merge(M, h_ext, offs,
                                                 initial_state.double() if cfg.initial_state else None)
        starts.copy_(got_starts)
        if not cfg.starts_only:
            final.copy_(got_final)


class PrepEmulator:
    """`ChunkPrepSm90`'s contract (`PrepConfig`): `chunk_prep_torch` per sequence (of the tile table's spans),
    written into the output slots the build writes (GDN folded: update_key, intra and the per-token factors;
    KDA folded: query, key, update_key, intra, decay; the solved terms: all six)."""

    def __init__(self, config):
        self.config = config

    def fn(self, q, k, v, g, beta, a_log, dt_bias, lower_bound, query, key, value, update_key, intra, decay, tiles,
           num_tiles, grid, scale, flags, chunks_per_seq, consumers):
        from cute_kernels.paths.two_phase import chunk_prep_torch

        cfg = self.config
        g, beta = gated(cfg, g, beta, a_log, dt_bias, lower_bound)
        folded = cfg.terms == "folded"
        B, T = q.shape[:2]
        spans = {}
        for t in rows(tiles, num_tiles):   # each sequence's token span (the tiles' union)
            a, e = spans.get(t["seq"], (t["tok_start"], t["tok_end"]))
            spans[t["seq"]] = (min(a, t["tok_start"]), max(e, t["tok_end"]))
        flat = lambda x: x.flatten(0, 1)   # noqa: E731
        outs = {name: flat(x) for name, x in (("query", query), ("key", key), ("value", value),
                                               ("update_key", update_key), ("intra", intra), ("decay", decay))}
        src = [flat(x) for x in (q, k, v, g, beta)]
        for a, e in spans.values():
            if e == a:
                continue
            p = chunk_prep_torch(*(x[a:e][None] for x in src), scale, kda=cfg.kda, folded=folded)
            if folded and not cfg.kda:   # W2, A1 and the per-token factors (q, k, v are the call's)
                outs["update_key"][a:e] = p.update_key[0]
                outs["intra"][a:e] = p.intra[0]
                eG = p.decay[0]   # exp(G) of every token, [L, H]
                last = torch.tensor([min(t - t % 64 + 63, e - a - 1) for t in range(e - a)])
                outs["decay"][a:e] = torch.stack([scale * eG, eG[last] / eG, eG[last], eG], -1)
                continue
            written = ("query", "key", "update_key", "intra", "decay") + (() if folded else ("value",))
            for name in written:
                outs[name][a:e] = getattr(p, name)[0]


class StatePassEmulator:
    """`ChunkStatePassSm90`'s contract (`StateConfig`), tile by tile, in float64."""

    def __init__(self, config):
        self.config = config

    def fn(self, query, key, value, update_key, intra, decay, o, s0, sN, tiles, num_tiles, grid, flags,
           chunks_per_seq):
        cfg = self.config
        query, key, value, update_key, intra, decay, o = (x.flatten(0, 1) for x in (query, key, value, update_key,
                                                                                    intra, decay, o))
        e_k = None   # token_factors: R = v - diag(2^G) k S stands in for v_new
        if cfg.token_factors:   # decay: (scale 2^G, 2^(G_L - G), 2^G_L, 2^G)
            query, e_k, decay = query.double() * decay[..., 0:1], decay[..., 3].double(), decay[..., 2]
        n_vb = o.shape[-1] // 64
        for t in rows(tiles, num_tiles):
            h, blk, a, b = t["head"], t["block"], t["tok_start"], t["tok_end"]
            is_m = cfg.mode == "summary" and blk >= n_vb
            v0 = 64 * (blk - n_vb if is_m else blk)
            cols = slice(v0, v0 + 64)
            if cfg.mode == "summary":
                S = torch.eye(128, dtype=torch.float64)[:, cols].clone() if is_m else torch.zeros(128, 64).double()
            elif cfg.mode == "segment_outputs":
                S = s0[t["seg_slot"], h, :, cols].double()
            else:
                S = s0[t["seq"], h, :, cols].double() if cfg.initial_state else torch.zeros(128, 64).double()
            for c0 in range(a, b, 64):
                c1 = min(c0 + 64, b)
                L = c1 - c0
                U = torch.zeros(L, 64).double() if is_m else value[c0:c1, h, cols].double()
                kS = key[c0:c1, h].double() @ S
                v_new = U - (kS if e_k is None else e_k[c0:c1, h, None] * kS)
                if cfg.mode != "summary":
                    o[c0:c1, h, cols] = (query[c0:c1, h].double() @ S
                                         + intra[c0:c1, h, :L].double() @ v_new).to(o.dtype)
                d = decay[c1 - 1, h].double()
                S = (d[:, None] if cfg.kda else d) * S + update_key[c0:c1, h].double().T @ v_new
            if cfg.mode == "summary":
                sN[t["seg_slot"] + (sN.shape[0] // 2 if is_m else 0), h, :, cols] = S.float()
            elif cfg.final_state and t["segment"] == t["num_segments"] - 1:
                sN[t["seq"], h, :, cols] = S.float()


class L2NormEmulator:
    """`QKL2Norm`'s contract: rows / sqrt(sum of squares + 1e-6), in float64, cast back."""

    def fn(self, q, k, qn, kn):
        for x, y in ((q, qn), (k, kn)):
            xd = x.double()
            y.copy_((xd / torch.sqrt((xd * xd).sum(-1, keepdim=True) + 1e-6)).to(y.dtype))


class Builds(list):
    """The configs the emulated builds were asked for, in order."""


def emulate(monkeypatch, sms: int = 132) -> Builds:
    """Swap the emulators in for every compiled kernel, make the ops take CPU tensors as a `sms`-SM SM90 device,
    and drop the cached plans and runners. Returns the list of configs built (fused, prep, state, merge)."""
    import cute_kernels.ops.linear_attention as la
    import cute_kernels.paths.fused as fused
    import cute_kernels.paths.merge as merge
    import cute_kernels.paths.two_phase as two_phase
    import cute_kernels.plan as plan

    builds = Builds()

    def fake(cls):
        def build(config, *dtypes, dump_dir=None):
            builds.append(config)
            return cls(config)
        return build

    monkeypatch.setattr(fused, "build_fused", fake(FusedEmulator))
    monkeypatch.setattr(merge, "build_affine_merge", fake(MergeEmulator))
    monkeypatch.setattr(two_phase, "build_prep", fake(PrepEmulator))
    monkeypatch.setattr(two_phase, "build_state_pass", fake(StatePassEmulator))
    monkeypatch.setattr(la, "build_qk_l2norm", lambda io, dump_dir=None: L2NormEmulator())
    monkeypatch.setattr(la, "check_cuda", lambda **kw: torch.device("cpu"))
    monkeypatch.setattr(la, "sm_count", lambda device: sms)
    monkeypatch.setattr(la, "device_kind", lambda device: "H200")
    monkeypatch.setattr(two_phase, "check_cuda", lambda **kw: torch.device("cpu"), raising=False)
    monkeypatch.setattr(plan, "_plans", {})
    monkeypatch.setattr(la, "_runs", {})
    return builds
