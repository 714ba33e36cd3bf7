"""The issue-38 check of a rewrite's speed: eight seed cells per op (B*H in 4, 32, 256, 1024; T in 1024, 8192),
timed per tree in its own process and compared in one table.

    PYTHONPATH=old_tree python3 scripts/seed_cells.py time ours OUT_old.json [gdn,kda]
    python3 scripts/seed_cells.py time ours OUT_new.json [gdn,kda]
    python3 scripts/seed_cells.py time fla OUT_fla.json
    python3 scripts/seed_cells.py compare OUT_new.json OUT_old.json [OUT_fla.json]

`time` records each cell's GPU time (median of CUDA-graph replays) and eager wall time. `compare` prints new / old
per cell (the rewrite must stay within +-3%), the committed number of the same card from
benchmarks/results/*_seed-latest_*.json where the cell is there, and FLA's time beside them. Several `time` runs
into the same file keep the fastest GPU time per cell (runs alternated between trees cancel clock drift).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

CELLS = [(1, 4, 1024), (1, 4, 8192), (2, 16, 1024), (2, 16, 8192), (8, 32, 1024), (8, 32, 8192), (16, 64, 1024),
         (16, 64, 8192)]
OPS = ("gdn", "kda")
TOLERANCE = 0.03


def eager_us(fn, calls: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def function(impl: str, op: str):
    if impl == "ours":
        import cute_kernels as ck

        return ck.chunk_kda if op == "kda" else ck.chunk_gated_delta_rule
    if op == "kda":
        from fla.ops.kda import chunk_kda

        return chunk_kda
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def time_cells(impl: str, path: str, ops=OPS) -> int:
    import torch
    import torch.nn.functional as F

    from benchmarks.sweep import graph_replay_us

    rows = json.load(open(path)) if os.path.exists(path) else {}
    rows.setdefault("device", torch.cuda.get_device_name())
    for op in ops:
        fn = function(impl, op)
        for B, H, T in CELLS:
            gen = torch.Generator(device="cuda").manual_seed(B * T + H)
            shape = (B, T, H, 128) if op == "kda" else (B, T, H)
            x = {
                "q": F.normalize(torch.randn(B, T, H, 128, device="cuda", generator=gen), dim=-1).bfloat16(),
                "k": F.normalize(torch.randn(B, T, H, 128, device="cuda", generator=gen), dim=-1).bfloat16(),
                "v": torch.randn(B, T, H, 128, device="cuda", generator=gen).bfloat16(),
                "g": F.logsigmoid(torch.randn(shape, device="cuda", generator=gen)).clamp(min=-5.0),
                "beta": torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=gen)).bfloat16(),
            }

            def call(fn=fn, x=x):
                return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=None, initial_state=None,
                          output_final_state=True, cu_seqlens=None)

            with torch.inference_mode():
                call()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                rough = (time.perf_counter() - t0) * 1e6
                calls = max(1, min(50, int(20000 / max(rough, 1.0))))
                gpu = graph_replay_us(call, calls=calls)
                eager = eager_us(call, max(3, calls))
            key = f"{op} {B} {H} {T}"
            old = rows.get(key)
            best = gpu if old is None else min(gpu, old["gpu_us"])
            rows[key] = {"gpu_us": best, "eager_us": eager, "runs": (old or {}).get("runs", 0) + 1}
            print(f"{impl} {key:18s} GPU {gpu:9.1f} us (best {best:9.1f})  eager {eager:9.1f} us", flush=True)
            # Written after every cell: a run stopped by its time limit (FLA's autotuning) keeps what it measured.
            with open(path + ".tmp", "w") as f:
                json.dump(rows, f, indent=1)
            os.replace(path + ".tmp", path)
            del x, call
            torch.cuda.empty_cache()
    return 0


def committed(device: str) -> dict:
    """(op, B, H, T) -> ours' committed CUDA-graph time on this card, from benchmarks/results."""
    tag = "h200" if "H200" in device else "h100"
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "results")
    out = {}
    for f in glob.glob(os.path.join(root, f"*_seed-latest_{tag}_*.json")):
        for r in json.load(open(f))["rows"]:
            us = (r.get("extra") or {}).get("ours_graph_us")
            if us:
                out[(r["op"], r["B"], r["H"], r["T"])] = us
    return out


def compare(new_path: str, old_path: str, fla_path: str | None) -> int:
    new, old = json.load(open(new_path)), json.load(open(old_path))
    fla = json.load(open(fla_path)) if fla_path and os.path.exists(fla_path) else {}
    ref = committed(new["device"])
    print(f"{new['device']}: GPU time (us, CUDA-graph replay, the best of the alternated runs); "
          f"new / old within +-{TOLERANCE:.0%}")
    print(f"{'cell':18s} {'new':>9s} {'old':>9s} {'new/old':>8s} {'committed':>10s} {'FLA':>9s} {'FLA/new':>8s}"
          f" {'new eager':>10s}")
    bad = 0
    ops = [op for op in OPS if any(k.startswith(op + " ") for k in new)]   # the ops this run timed
    for op in ops:
        for B, H, T in CELLS:
            key = f"{op} {B} {H} {T}"
            if key not in new or key not in old:
                print(f"{key:18s} missing")
                bad += 1
                continue
            n, o = new[key]["gpu_us"], old[key]["gpu_us"]
            ratio = n / o
            ok = abs(ratio - 1) <= TOLERANCE
            bad += not ok
            c = ref.get((op, B, H, T))
            f = fla.get(key, {}).get("gpu_us")
            print(f"{key:18s} {n:9.1f} {o:9.1f} {ratio:8.3f} {c if c else float('nan'):10.1f} "
                  f"{f if f else float('nan'):9.1f} {(f / n) if f else float('nan'):8.2f} "
                  f"{new[key]['eager_us']:10.1f} {'' if ok else 'OUTSIDE +-3%'}")
    print(f"seed_cells: {len(ops) * len(CELLS) - bad} of {len(ops) * len(CELLS)} cells within +-{TOLERANCE:.0%}")
    return 1 if bad else 0


def main(argv) -> int:
    if argv[0] == "time":
        return time_cells(argv[1], argv[2], tuple(argv[3].split(",")) if len(argv) > 3 else OPS)
    return compare(argv[1], argv[2], argv[3] if len(argv) > 3 else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
