"""Bitwise comparison of two builds of the chunk-local kernels (e.g. a rewrite that keeps every sum's order):

    PYTHONPATH=old_src python3 scripts/compare_builds.py save /tmp/ref.pt    # the old sources (an export of HEAD)
    python3 scripts/compare_builds.py check /tmp/ref.pt                     # this tree

Saves / compares phase 1's terms (GDN slim and one CTA per SM, KDA) and the fused forward's outputs (GDN, KDA)
on fixed random inputs (seeded on the CPU, so both runs see the same values).
"""

import sys

import torch
import torch.nn.functional as F


def inputs(kda, B, H, T, seed):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16()
    v = torch.randn(B, T, H, 128, generator=gen).bfloat16()
    g = F.logsigmoid(torch.randn((B, T, H, 128) if kda else (B, T, H), generator=gen)).clamp(min=-5)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).bfloat16()
    return [x.cuda() for x in (q, k, v, g, beta)]


def results():
    import cute_kernels as ck
    from cute_kernels.ops import linear_attention as la
    from cute_kernels.ops import two_phase

    print("cute_kernels from", ck.__file__, flush=True)
    out = {}
    for kda in (False, True):
        for B, H, T in ((1, 4, 1000), (2, 3, 300)):
            q, k, v, g, beta = inputs(kda, B, H, T, 7 * T + B)
            name = f"{'kda' if kda else 'gdn'} B={B} H={H} T={T}"
            for slim in ((True, False) if not kda else (False,)):
                two_phase.PREP_SLIM = slim
                t = two_phase.chunk_prep(q, k, v, g, beta, kda=kda).gated()   # comparable across GDN_RAW_QK
                for field in ("qg", "w", "u", "kg", "aqk"):
                    out[f"{name} prep slim={slim} {field}"] = getattr(t, field).cpu()
            two_phase.PREP_SLIM = True
            la.TWO_PHASE = "0"
            fn = ck.chunk_kda if kda else ck.chunk_gated_delta_rule
            o, s = fn(q, k, v, g, beta, output_final_state=True)
            out[f"{name} fused o"], out[f"{name} fused state"] = o.cpu(), s.cpu()
            la.TWO_PHASE = "auto"
    return out


def main():
    mode, path = sys.argv[1], sys.argv[2]
    res = results()
    if mode == "save":
        torch.save(res, path)
        print(f"saved {len(res)} tensors to {path}")
        return
    ref = torch.load(path)
    bad = 0
    for key, x in res.items():
        y = ref[key]
        same = torch.equal(x, y)
        nan = bool(x.float().isnan().any())
        diff = (x.float() - y.float()).abs().max().item() if x.shape == y.shape else float("inf")
        bad += (not same) or nan
        print(f"{key:<40s} bitwise {same}  NaN {nan}  max |diff| {diff:.3g}")
    print(f"compare_builds: {len(res) - bad} of {len(res)} bitwise equal, no NaN")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
