"""Quick GPU check of the SM90 GDN forward: a few cases against float64, then timings (prints as it goes)."""

import sys
import time

import torch
import torch.nn.functional as F

import cute_kernels as ck
from cute_kernels import reference as ref


def inputs(B, T, H, seed, dev="cuda", kda=False):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16().to(dev)
    k = F.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16().to(dev)
    v = torch.randn(B, T, H, 128, generator=gen).bfloat16().to(dev)
    g = F.logsigmoid(torch.randn((B, T, H, 128) if kda else (B, T, H), generator=gen)).clamp(min=-5.0).to(dev)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).bfloat16().to(dev)
    return q, k, v, g, beta


def err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


for B, T, H, init, cu in [(1, 100, 1, False, None), (1, 64, 1, True, None), (3, 1000, 4, True, None),
                          (1, 3000, 4, False, [0, 1, 65, 65, 1000, 1063, 3000])]:
    t0 = time.time()
    q, k, v, g, beta = inputs(B, T, H, T + B)
    N = B if cu is None else len(cu) - 1
    s0 = torch.randn(N, H, 128, 128, device="cuda") * 0.1 if init else None
    cut = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    o, s = ck.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cut)
    torch.cuda.synchronize()
    wo, ws = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                           cu_seqlens=cut)
    o2, s2 = ck.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cut)
    print(f"B={B} T={T} H={H} init={init} varlen={cu is not None}: o err {err(o, wo):.2e}, state err "
          f"{err(s, ws):.2e}, nan {bool(o.isnan().any())}, same twice {torch.equal(o, o2) and torch.equal(s, s2)} "
          f"({time.time() - t0:.1f}s)", flush=True)

import triton.testing as tt

try:
    import fla.ops.gated_delta_rule as fla_gdn
    import fla.ops.kda as fla_kda
except ImportError:
    fla_gdn = fla_kda = None


def bench(fn):
    fn()
    return tt.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


for B, T, H, init in [(2, 1000, 3, True), (1, 100, 1, False)]:
    q, k, v, g, beta = inputs(B, T, H, 3, kda=True)
    s0 = torch.randn(B, H, 128, 128, device="cuda") * 0.1 if init else None
    o, s = ck.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    wo, ws = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    print(f"KDA B={B} T={T} H={H}: o err {err(o, wo):.2e}, state err {err(s, ws):.2e}, nan {bool(o.isnan().any())}",
          flush=True)
shapes = [(1, 4, 8192), (4, 16, 8192), (16, 64, 4096)] if len(sys.argv) < 2 else []
for name, ours, peer in [("gdn", ck.chunk_gated_delta_rule, fla_gdn and fla_gdn.chunk_gated_delta_rule),
                         ("kda", ck.chunk_kda, fla_kda and fla_kda.chunk_kda)]:
    for B, H, T in shapes:
        q, k, v, g, beta = inputs(B, T, H, 1, kda=name == "kda")
        us = bench(lambda: ours(q, k, v, g, beta, output_final_state=True))
        fla_us = bench(lambda: peer(q, k, v, g, beta, output_final_state=True)) if peer else float("nan")
        print(f"{name} B={B} H={H} T={T}: ours {us:.1f} us ({us / (T // 64) / -(-B * H // 132):.2f} us per chunk "
              f"per CTA), FLA {fla_us:.1f} us, speed-up {fla_us / us:.2f}x", flush=True)
