"""Each rs state-pass variant (exp(G_last) in the ring, o by TMA store, u_fast: on or off) in its own
process, so one fault does not hide the others: error against the smem state pass (unsegmented) on the same
phase-1 terms, NaN check, and the fault if any.

    python3 scripts/state_variants_check.py                  # every variant x op x shape, 8 processes at a time
    VARIANTS=ring,ring+o python3 scripts/state_variants_check.py
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

# (exp(G_last) in the ring, o by TMA store, u at constant offsets); VARIANTS=name,name picks some
ALL = {"direct": (0, 0, 0), "ring": (1, 0, 0), "ring+o": (1, 1, 0), "ring+ufast": (1, 0, 1)}
VARIANTS = {k: ALL[k] for k in os.environ.get("VARIANTS", ",".join(ALL)).split(",")}
# (B, T, H, segments per sequence: > 1 runs the summary and segment-output kernels)
SHAPES = [(1, 64, 1, 1), (1, 256, 4, 1), (2, 1000, 3, 1), (1, 8192, 4, 1), (2, 1000, 3, 3), (1, 8192, 4, 5)]


def one(op, name, B, T, H, N):
    import torch

    from benchmarks.ops import make_inputs
    from cute_kernels.ops import two_phase

    td, to, uf = ALL[name]
    kda = op == "kda"
    x = make_inputs(op, B, H, T, torch.bfloat16, "cuda")
    prep = two_phase.chunk_prep_torch(x["q"], x["k"], x["v"], x["g"], x["beta"], kda=kda)
    two_phase.STATE_PASS_RS = False
    want, want_s = two_phase.state_pass(prep, None, True)
    two_phase.STATE_PASS_RS, two_phase.STATE_RING_DECAY = True, bool(td)
    two_phase.STATE_O_TMA, two_phase.STATE_U_FAST = bool(to), bool(uf)
    o = torch.full_like(want, float("nan"))
    s = torch.full_like(want_s, float("nan"))
    two_phase.state_pass(prep, None, True, num_segments=N, out=(o, s))
    torch.cuda.synchronize()
    err = ((o.float() - want.float()).norm() / want.float().norm()).item()
    err_s = ((s - want_s).norm() / want_s.norm()).item()
    print(f"nan={bool(o.isnan().any() or s.isnan().any())} err_o={err:.2e} err_s={err_s:.2e} "
          f"bitwise_o={torch.equal(o, want)}")


def main():
    if len(sys.argv) == 7:
        return one(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
    jobs = [(op, name, B, T, H, N) for op in ("gdn", "kda") for name in VARIANTS for B, T, H, N in SHAPES]
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")

    def run(job):
        p = subprocess.run([sys.executable, __file__, *map(str, job)], capture_output=True, text=True, env=env,
                           timeout=240)
        lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip() and "Warn" not in ln]
        res = lines[-1] if p.returncode == 0 and lines else "FAIL rc=%d: %s" % (p.returncode, " | ".join(
            ln for ln in lines if "Error" in ln or "error" in ln)[-300:])
        return f"{job[0]} {job[1]:8s} B={job[2]} T={job[3]} H={job[4]} N={job[5]}: {res}"

    with ThreadPoolExecutor(8) as ex:
        for line in ex.map(run, jobs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
