"""Each rs state-pass variant (exp(G_last) / o by TMA or not) in its own process, so one fault does not hide the
others: error against the smem state pass on the same phase-1 terms, NaN check, and the fault if any.

    python3 scripts/state_variants_check.py            # every variant x op x shape, 8 processes at a time
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

VARIANTS = {"direct": (0, 0), "decay": (1, 0), "o": (0, 1), "decay+o": (1, 1)}
SHAPES = [(1, 64, 1), (1, 256, 4), (2, 1000, 3), (1, 8192, 4)]


def one(op, name, B, T, H):
    import torch

    from benchmarks.ops import make_inputs
    from cute_kernels.ops import two_phase

    td, to = VARIANTS[name]
    kda = op == "kda"
    x = make_inputs(op, B, H, T, torch.bfloat16, "cuda")
    prep = two_phase.chunk_prep_torch(x["q"], x["k"], x["v"], x["g"], x["beta"], kda=kda)
    two_phase.STATE_PASS_RS = False
    want, want_s = two_phase.state_pass(prep, None, True)
    two_phase.STATE_PASS_RS, two_phase.STATE_RING_DECAY, two_phase.STATE_O_TMA = True, bool(td), bool(to)
    o = torch.full_like(want, float("nan"))
    s = torch.full_like(want_s, float("nan"))
    two_phase.state_pass(prep, None, True, out=(o, s))
    torch.cuda.synchronize()
    err = ((o.float() - want.float()).norm() / want.float().norm()).item()
    err_s = ((s - want_s).norm() / want_s.norm()).item()
    print(f"nan={bool(o.isnan().any() or s.isnan().any())} err_o={err:.2e} err_s={err_s:.2e} "
          f"bitwise_o={torch.equal(o, want)}")


def main():
    if len(sys.argv) == 6:
        return one(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
    jobs = [(op, name, B, T, H) for op in ("gdn", "kda") for name in VARIANTS for B, T, H in SHAPES]
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")

    def run(job):
        p = subprocess.run([sys.executable, __file__, *map(str, job)], capture_output=True, text=True, env=env,
                           timeout=240)
        lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip() and "Warn" not in ln]
        res = lines[-1] if p.returncode == 0 and lines else "FAIL rc=%d: %s" % (p.returncode, " | ".join(
            ln for ln in lines if "Error" in ln or "error" in ln)[-300:])
        return f"{job[0]} {job[1]:8s} B={job[2]} T={job[3]} H={job[4]}: {res}"

    with ThreadPoolExecutor(8) as ex:
        for line in ex.map(run, jobs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
