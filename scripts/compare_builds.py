"""Compare two builds of the kernels: their PTX (no GPU), or their outputs bitwise (GPU).

    python -m cute_kernels compile --arch sm_90a --out /tmp/a          # in each tree (PYTHONPATH=the tree)
    python3 scripts/compare_builds.py ptx /tmp/a /tmp/b                # per variant: identical, the same code
                                                                       # up to params / shared offsets / registers,
                                                                       # or CODE DIFFERS (with the first lines)
    PYTHONPATH=old_tree python3 scripts/compare_builds.py save /tmp/ref.pt   # GPU: outputs of the old tree
    python3 scripts/compare_builds.py check /tmp/ref.pt                      # this tree's, bitwise against them

The GPU mode runs each path of the op (fused, two-phase, overlapped) on fixed inputs (seeded on the CPU, so both trees see
the same values) and compares o and the final state.
"""

from __future__ import annotations

import difflib
import os
import re
import sys


def _lines(text: str) -> list[str]:
    text = re.sub(r"\b(kernel_[A-Za-z0-9_]+|cutlass_[A-Za-z0-9_]+)\b", "KERNEL", text)   # names hash their args
    text = re.sub(r"//.*", "", text)
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def _code(lines: list[str]) -> list[str]:
    """The instructions without kernel parameters, shared-memory offsets and register numbers."""
    out = []
    for line in lines:
        if line.strip().startswith((".param", ".shared")) or ".reg " in line:
            continue
        line = re.sub(r"%(r|rd|f|fd|p|rs|h|hh)\d+", r"%\1", line)
        out.append(re.sub(r"\+\d+\]", "+N]", line))
    return out


def ptx(dir_a: str, dir_b: str) -> int:
    names = sorted(n for n in os.listdir(dir_a) if n.endswith(".ptx"))
    differs = 0
    for name in names:
        path_b = os.path.join(dir_b, name)
        if not os.path.exists(path_b):
            print(f"{name}: missing in {dir_b}")
            differs += 1
            continue
        with open(os.path.join(dir_a, name)) as fa, open(path_b) as fb:
            a, b = _lines(fa.read()), _lines(fb.read())
        if a == b:
            print(f"{name}: identical")
        elif _code(a) == _code(b):
            print(f"{name}: the same code up to params / shared offsets / registers")
        else:
            differs += 1
            diff = list(difflib.unified_diff(_code(a), _code(b), lineterm="", n=1))
            print(f"{name}: CODE DIFFERS\n" + "\n".join(diff[:40]))
    print(f"compare_builds: {len(names) - differs} of {len(names)} the same code")
    return 1 if differs else 0


def outputs() -> dict:
    import torch

    import cute_kernels as ck
    import cute_kernels.ops.linear_attention as la

    try:
        from cute_kernels.plan import PlanOptions
    except ImportError:   # a tree from before the planner: the path came from module globals
        PlanOptions = None
    modes = {"fused": ("0", "0", "never"), "two_phase": ("1", "0", "never"), "overlap": ("1", "1", "always")}
    out = {}
    for kda in (False, True):
        for B, H, T in ((1, 4, 1000), (2, 3, 300), (1, 4, 4100)):
            gen = torch.Generator().manual_seed(7 * T + B)
            q = torch.nn.functional.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16()
            k = torch.nn.functional.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16()
            v = torch.randn(B, T, H, 128, generator=gen).bfloat16()
            g = -0.02 * torch.rand((B, T, H, 128) if kda else (B, T, H), generator=gen)
            beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).bfloat16()
            x = [t.cuda() for t in (q, k, v, g, beta)]
            for path, (two_phase, overlap, overlap_mode) in modes.items():
                if PlanOptions is None:
                    la.TWO_PHASE, la.OVERLAP = two_phase, overlap
                    o, s = (ck.chunk_kda if kda else ck.chunk_gated_delta_rule)(*x, output_final_state=True)
                else:
                    options = PlanOptions("fused" if path == "fused" else "two_phase", overlap=overlap_mode)
                    o, s = la.forward(*x, None, None, True, None, False, None, None, kda=kda, options=options)
                name = f"{'kda' if kda else 'gdn'} B={B} H={H} T={T} {path}"
                out[f"{name} o"], out[f"{name} state"] = o.cpu(), s.cpu()
    return out


def main() -> int:
    mode = sys.argv[1]
    if mode == "ptx":
        return ptx(sys.argv[2], sys.argv[3])
    import torch

    res = outputs()
    if mode == "save":
        torch.save(res, sys.argv[2])
        print(f"saved {len(res)} tensors to {sys.argv[2]}")
        return 0
    ref = torch.load(sys.argv[2])
    bad = 0
    for key, x in res.items():
        y = ref[key]
        same = torch.equal(x, y)
        nan = bool(x.float().isnan().any())
        bad += (not same) or nan
        print(f"{key:<40s} bitwise {same}  NaN {nan}  max |diff| {(x.float() - y.float()).abs().max().item():.3g}")
    print(f"compare_builds: {len(res) - bad} of {len(res)} bitwise equal, no NaN")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
