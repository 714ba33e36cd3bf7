"""Where the SM90 GDN/KDA forward spends its time: time it whole and with one stage left out at a time.

`python3 scripts/gdn_profile.py [gdn|kda]` on the GPU machine. The difference to the full time
is that stage's cost (results of the skipped variants are wrong; only their timing is used).
"""

import sys

import torch
import torch.nn.functional as F
import triton.testing as tt

import cute_kernels as ck
import cute_kernels.ops.linear_attention as la

op = sys.argv[1] if len(sys.argv) > 1 else "gdn"
kda = op == "kda"
B, H, T = 16, 64, 4096  # fills the GPU: 1024 tiles, 64 chunks each
gen = torch.Generator().manual_seed(0)
q = F.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16().cuda()
k = F.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16().cuda()
v = torch.randn(B, T, H, 128, generator=gen).bfloat16().cuda()
g = F.logsigmoid(torch.randn((B, T, H, 128) if kda else (B, T, H), generator=gen)).clamp(min=-5).cuda()
beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).bfloat16().cuda()
fn = ck.chunk_kda if kda else ck.chunk_gated_delta_rule
chunks_per_cta = T // 64
waves = -(-B * H // torch.cuda.get_device_properties(0).multi_processor_count)
full = None
stages = ["gates", "intra"] + (["gating"] if kda else []) + ["solve", "wu", "vnew", "out", "state"]  # GDN: no gating pass
for skip in [()] + [(s,) for s in stages] + [tuple(stages)]:
    la.GDN_SKIP = skip
    run = lambda: fn(q, k, v, g, beta, output_final_state=True)
    run()
    us = tt.do_bench(run, warmup=10, rep=40, return_mode="median") * 1e3
    per_chunk = us / (waves * chunks_per_cta)
    if full is None:
        full = us
        print(f"{op} B={B} H={H} T={T}: {us:.0f} us = {per_chunk:.2f} us per chunk per CTA", flush=True)
    else:
        print(f"  without {'+'.join(skip):<45s} {us:8.0f} us  (stage ~{(full - us) / (waves * chunks_per_cta):.2f} us/chunk)",
              flush=True)
la.GDN_SKIP = ()
