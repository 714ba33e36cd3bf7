"""The issue-38 check of a rewrite's speed: eight seed cells per op (B*H in 4, 32, 256, 1024; T in 1024, 8192),
timed per tree in its own process and compared in one table.

    PYTHONPATH=old_tree python3 scripts/seed_cells.py time ours OUT_old.json [gdn,kda] [plain,gate,l2norm]
    python3 scripts/seed_cells.py time ours OUT_new.json [gdn,kda] [plain,gate,l2norm]
    python3 scripts/seed_cells.py time fla OUT_fla.json
    python3 scripts/seed_cells.py compare OUT_new.json OUT_old.json [OUT_fla.json]

`time` records each cell's GPU time (median of CUDA-graph replays) and eager wall time. `compare` prints new / old
per cell (the rewrite must stay within +-3%), the committed number of the same card from
benchmarks/results/*_seed-latest_*.json where the cell is there, and FLA's time beside them. Several `time` runs
into the same file keep the fastest GPU time per cell (runs alternated between trees cancel clock drift).
Forms (default `plain`): `gate` passes FLA's gate arguments (raw g with use_gate_in_kernel, A_log, dt_bias, KDA's
lower_bound; beta as logits with use_beta_sigmoid_in_kernel), `l2norm` raw q, k with use_qk_l2norm_in_kernel.
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
FORMS = ("plain", "gate", "l2norm")
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


def cell_key(op: str, form: str, B: int, H: int, T: int) -> str:
    return f"{op if form == 'plain' else op + '+' + form} {B} {H} {T}"


def inputs(op: str, form: str, B: int, H: int, T: int):
    """A cell's arguments for `form` (see the module docstring): (positional tensors, keyword arguments)."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(B * T + H)
    shape = (B, T, H, 128) if op == "kda" else (B, T, H)
    rand = lambda *s: torch.randn(*s, device="cuda", generator=gen)   # noqa: E731
    q, k = rand(B, T, H, 128), rand(B, T, H, 128)
    if form != "l2norm":
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    x = [q.bfloat16(), k.bfloat16(), rand(B, T, H, 128).bfloat16(), F.logsigmoid(rand(*shape)).clamp(min=-5.0),
         torch.sigmoid(rand(B, T, H)).bfloat16()]
    kw = {"use_qk_l2norm_in_kernel": form == "l2norm"}
    if form == "gate":
        x[3], x[4] = rand(*shape), rand(B, T, H).bfloat16()   # raw gate and beta logits
        kw.update(use_gate_in_kernel=True, A_log=rand(H) * 0.5 - 2, use_beta_sigmoid_in_kernel=True,
                  dt_bias=0.5 * rand(H * 128 if op == "kda" else H))
        if op == "kda":
            kw["lower_bound"] = -5.0
    return x, kw


def time_cells(impl: str, path: str, ops=OPS, forms=("plain",)) -> int:
    import torch

    from benchmarks.sweep import graph_replay_us

    rows = json.load(open(path)) if os.path.exists(path) else {}
    rows.setdefault("device", torch.cuda.get_device_name())
    for op, form in ((op, form) for op in ops for form in forms):
        fn = function(impl, op)
        for B, H, T in CELLS:
            x, kw = inputs(op, form, B, H, T)

            def call(fn=fn, x=x, kw=kw):
                return fn(*x, scale=None, initial_state=None, output_final_state=True, cu_seqlens=None, **kw)

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
            key = cell_key(op, form, B, H, T)
            old = rows.get(key)
            best = gpu if old is None else min(gpu, old["gpu_us"])
            rows[key] = {"gpu_us": best, "eager_us": eager, "runs": (old or {}).get("runs", 0) + 1}
            print(f"{impl} {key:20s} GPU {gpu:9.1f} us (best {best:9.1f})  eager {eager:9.1f} us", flush=True)
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
    print(f"{'cell':20s} {'new':>9s} {'old':>9s} {'new/old':>8s} {'committed':>10s} {'FLA':>9s} {'FLA/new':>8s}"
          f" {'new eager':>10s}")
    bad = 0
    timed = [(op, form) for op in OPS for form in FORMS   # the ops and forms this run timed
             if any(k.startswith(cell_key(op, form, 0, 0, 0).split(" ")[0] + " ") for k in new)]
    for op, form in timed:
        for B, H, T in CELLS:
            key = cell_key(op, form, B, H, T)
            if key not in new or key not in old:
                print(f"{key:20s} missing")
                bad += 1
                continue
            n, o = new[key]["gpu_us"], old[key]["gpu_us"]
            ratio = n / o
            ok = abs(ratio - 1) <= TOLERANCE
            bad += not ok
            c = ref.get((op, B, H, T)) if form == "plain" else None
            f = fla.get(key, {}).get("gpu_us")
            print(f"{key:20s} {n:9.1f} {o:9.1f} {ratio:8.3f} {c if c else float('nan'):10.1f} "
                  f"{f if f else float('nan'):9.1f} {(f / n) if f else float('nan'):8.2f} "
                  f"{new[key]['eager_us']:10.1f} {'' if ok else 'OUTSIDE +-3%'}")
    print(f"seed_cells: {len(timed) * len(CELLS) - bad} of {len(timed) * len(CELLS)} cells within "
          f"+-{TOLERANCE:.0%}")
    return 1 if bad else 0


def main(argv) -> int:
    if argv[0] == "time":
        return time_cells(argv[1], argv[2], tuple(argv[3].split(",")) if len(argv) > 3 else OPS,
                          tuple(argv[4].split(",")) if len(argv) > 4 else ("plain",))
    return compare(argv[1], argv[2], argv[3] if len(argv) > 3 else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
