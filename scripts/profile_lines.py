"""Where one kernel spends its time, line by line: an op call under Nsight Compute's source counters, its warp-stall
samples summed per line of the kernel's Python (CuTe DSL compiled with CUTE_DSL_LINEINFO=1).

    python3 scripts/profile_lines.py run CASE                 # the call ncu profiles (run twice: compile, then time)
    python3 scripts/profile_lines.py report REPORT.ncu-rep|CSV  # per-line table of the report's first kernel
    bash scripts/device_check.sh profile-CASE                 # both, with ncu's flags (the GPU machine)

Cases: gdn-fused / kda-fused (the fused forward at B=8 H=32 T=4096: 256 (sequence, head) tiles, about two waves),
gdn-two-phase (phase 1), gdn-step / kda-step (the decode step, B=256 HV=32 Sq=8), decode (split-KV attention,
B=4 Hq=32 Hkv=8, 8K tokens), decode-small (B=1, 4K tokens: the small-batch fixed cost) and decode-short (B=16
Hq=32 Hkv=4, 512 tokens: 64 short units, the cells furthest behind torch SDPA). `CASES[name][0]` is the regex of
the kernel to profile.
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

# name: (kernel name regex for ncu -k, what to call)
CASES = {
    "gdn-fused": ("regex:ChunkedForward", ("forward", False, "fused")),
    "kda-fused": ("regex:ChunkedForward", ("forward", True, "fused")),
    "gdn-two-phase": ("regex:ChunkPrep", ("forward", False, "two_phase")),
    "gdn-step": ("regex:RecurrentStep", ("step", False, None)),
    "kda-step": ("regex:RecurrentStep", ("step", True, None)),
    "decode": ("regex:SplitKVDecode", ("decode", False, None)),
    "decode-small": ("regex:SplitKVDecode", ("decode", False, "small")),
    "decode-short": ("regex:SplitKVDecode", ("decode", False, "short")),
}


def run(name: str) -> None:
    import torch
    from inputs import initial_state, make_inputs

    _, (what, kda, path) = CASES[name]
    gen = torch.Generator().manual_seed(0)
    if what == "forward":
        from cute_kernels.ops import linear_attention as la
        from cute_kernels.plan import PlanOptions

        B, H, T = 8, 32, 4096
        q, k, v, g, beta = make_inputs(B, T, H, gen, "cuda", kda=kda, regime="weak")
        s0 = initial_state(B, H, gen, "cuda")
        la.forward(q, k, v, g, beta, None, s0, True, None, False, None, None, kda=kda, options=PlanOptions(path))
    elif what == "step":
        import cute_kernels as ck

        B, HV, Sq = 256, 32, 8
        q, k = (torch.nn.functional.normalize(torch.randn(B, Sq, HV, 128, device="cuda"), dim=-1).bfloat16()
                for _ in range(2))
        v = torch.randn(B, Sq, HV, 128, device="cuda").bfloat16()
        g = -0.05 * torch.rand((B, Sq, HV, 128) if kda else (B, Sq, HV), device="cuda")
        beta = torch.rand(B, Sq, HV, device="cuda").bfloat16()
        s0 = torch.randn(B, HV, 128, 128, device="cuda")
        step = ck.fused_recurrent_kda if kda else ck.fused_recurrent_gated_delta_rule
        step(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True)
    else:
        from cute_kernels import decode_attention

        B, Hq, Hkv, T = {"small": (1, 32, 8, 4096), "short": (16, 32, 4, 512)}.get(path, (4, 32, 8, 8192))
        q = torch.randn(B, Hq, 128, device="cuda").bfloat16()
        kc, vc = (torch.randn(B, T, Hkv, 128, device="cuda").bfloat16() for _ in range(2))
        decode_attention(q, kc, vc, torch.full((B,), T, dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()


def source_rows(text: str):
    """The per-source-line rows of ncu's source page (`--print-source cuda,sass --csv`): one section per file, each
    with its own header; a row with a line number sums the SASS rows under it."""
    path, header = None, None
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "File Path":
            path, header = row[1], None
        elif row[0] == "Line No":
            header = row
        elif header is not None and row[0].strip():
            yield path, header, row


def number(cell: str) -> float:
    try:
        return float(cell.replace(",", ""))
    except ValueError:   # "-": not measured on this row
        return 0.0


def report(path: str, top: int = 40) -> None:
    """Warp-stall samples per line of Python, with each line's three largest stall reasons. `path`: an .ncu-rep, or
    the CSV that `ncu --import R --page source --csv --print-source cuda,sass` wrote."""
    if path.endswith(".ncu-rep"):
        text = subprocess.run(["ncu", "--import", path, "--page", "source", "--csv", "--print-source", "cuda,sass"],
                              capture_output=True, text=True, check=True).stdout
    else:
        text = open(path).read()
    lines, per_file = [], {}
    for file, header, row in source_rows(text):
        col = header.index("Warp Stall Sampling (All Samples)")
        reasons = [(i, h) for i, h in enumerate(header) if h.startswith("stall_") and "(Not Issued)" not in h]
        n = number(row[col])
        if n == 0:
            continue
        why = sorted(((number(row[i]), h[6:]) for i, h in reasons), reverse=True)[:3]
        name = os.path.basename(file)
        lines.append((n, f"{name}:{row[0]}", row[1].strip(), why))
        per_file[name] = per_file.get(name, 0.0) + n
    total = sum(n for n, *_ in lines) or 1.0
    print(f"{path}: {int(total)} warp-stall samples on {len(lines)} source lines")
    for name, n in sorted(per_file.items(), key=lambda x: -x[1]):
        print(f"  {100 * n / total:6.2f}%  {name}")
    print(f"the top {top} lines (share, line, its largest stall reasons as shares of the line):")
    for n, where, src, why in sorted(lines, key=lambda x: -x[0])[:top]:
        reasons = " ".join(f"{r}={100 * v / n:.0f}%" for v, r in why if v)
        print(f"{100 * n / total:6.2f}%  {where:<22} {src[:70]:<70} {reasons}")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "run":
        run(sys.argv[2])
    elif len(sys.argv) >= 3 and sys.argv[1] == "report":
        report(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 40)
    else:
        print(__doc__)
        sys.exit(2)
