"""Time the two-phase path (phase 1 `chunk_prep`, phase 2 `state_pass`, each on its own) next to FLA and our fused
forward, all as GPU time from CUDA-graph replay (no host gaps). Prints one line per (op, B, H, T): both phases in
us, the state pass per chunk along the serial chain, FLA, ours fused (default scheduler), and the ratios.

    python3 scripts/time_two_phase.py            # on the H200, after the wheelhouse install
    python3 scripts/time_two_phase.py prep       # only GDN's phase 1, slim (two CTAs per SM) against one CTA per SM
    python3 scripts/time_two_phase.py state      # only phase 2: smem / rs chain, ring depth (STATE_VARIANTS)
    python3 scripts/time_two_phase.py chain      # phase 2's cycles per chunk by phase (the profile build)
    python3 scripts/time_two_phase.py prep-profile   # GDN phase 1 (slim): its time and cycles per step
    python3 scripts/time_two_phase.py paths      # large B x H: fused vs two-phase (forced), GDN and KDA, FLA beside
    python3 scripts/time_two_phase.py pair       # phase 2 with both V blocks per CTA (`pair`) vs one, then the op
    python3 scripts/time_two_phase.py pdl        # the op with programmatic dependent launch off / on
    python3 scripts/time_two_phase.py merge      # the op with the affine merge `prefetch` vs `regs`, FLA beside
    python3 scripts/time_two_phase.py phases     # the op's GPU time per kernel (profiler) at forced segment counts
    python3 scripts/time_two_phase.py solve-mma  # phase 1's solve levels on CUDA cores vs tf32 mma.sync, then the op
    python3 scripts/time_two_phase.py trio       # GDN phase 1 with two CTAs per SM against three, then the op
    python3 scripts/time_two_phase.py overlap    # the op with the overlapped path off ("auto" plan) / forced, FLA beside
    python3 scripts/time_two_phase.py balance    # GDN phase 1 on two-chunk tiles vs PREP_BALANCE's one wave, then the op
    python3 scripts/time_two_phase.py fold       # GDN's terms w, u vs GDN_FOLD's W2, A1: phase 1 alone, then the op
    python3 scripts/time_two_phase.py fold-chain # the state pass on w, u vs GDN_FOLD's terms: time, profile phases
    python3 scripts/time_two_phase.py pair-auto  # multi-wave state passes: one-block vs `pair` tiles, then the op
    python3 scripts/time_two_phase.py lookback   # the segmented state pass in one launch vs the split launches
    python3 scripts/time_two_phase.py one-pass   # split / look-back / one-pass / early-correction state passes, the op
    python3 scripts/time_two_phase.py kda-fold   # KDA's terms w, u vs KDA_FOLD's exp(G) k, W2, A1: phase 1, the op
"""

import dataclasses
import os
import sys

import torch

from benchmarks import ops
from cute_kernels.ops import linear_attention as la
from cute_kernels.ops import two_phase

CELLS = [(1, 4, 1024), (1, 4, 4096), (1, 4, 8192), (1, 4, 16384), (2, 16, 8192), (8, 8, 4096)]


def env_cells(name: str, default: str) -> list[tuple[int, ...]]:
    """(B, H, T) cells from the environment variable `name` ("B,H,T;B,H,T;..."), else from `default`."""
    return [tuple(int(v) for v in c.split(",")) for c in os.environ.get(name, default).split(";")]


def graph_us(fn, calls: int = 10, reps: int = 5) -> float:
    """GPU time per call: `calls` calls captured in one CUDA graph, replayed `reps` times (median)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def time_prep():
    """GDN phase 1, slim and not, and the per-chunk per-CTA cost the model (`two_phase.predicted_us`) should use."""
    from schedulers.heuristics import makespan

    best = None
    for B, H, T in CELLS + [(1, 16, 2048), (2, 16, 4096)]:
        x = ops.make_inputs("gdn", B, H, T, torch.bfloat16, "cuda")
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        chunks = -(-T // 64)
        tiles = [min(2, chunks - i) for _ in range(B * H) for i in range(0, chunks, 2)]
        line = []
        for slim in (False, True):
            two_phase.PREP_SLIM = slim
            t = graph_us(lambda: two_phase.chunk_prep(*args, kda=False))
            per = (t - two_phase.LAUNCH_US) / makespan(tiles, 132 * (2 if slim else 1))
            line.append(f"{'slim' if slim else 'one CTA/SM'} {t:.1f} us ({per:.2f} us per chunk per CTA)")
        two_phase.PREP_SLIM = True
        print(f"gdn prep B={B} H={H} T={T}: " + " | ".join(line), flush=True)
        if best is None or makespan(tiles, 264) > best[0]:
            best = (makespan(tiles, 264), per)
    # the fit from the cell with the most waves, for CUTE_KERNELS_PREP_SLIM_CHUNK_US
    print(f"slim per chunk per CTA (most waves): {best[1]:.2f} us")
    with open(os.path.join(os.environ.get("OUT", "."), "prep_slim_chunk_us.txt"), "w") as f:
        f.write(f"{best[1]:.2f}\n")


def time_state():
    """Phase 2 alone (phase-1 terms from the GPU prep), per chunk on the chain: the register (rs) state chain with
    a 2- or 3-stage ring ("rs2", "rs3"), and the smem-operand chain ("smem") (`STATE_VARIANTS` picks). Outputs of every variant must be bitwise equal to the first."""
    variants = os.environ.get("STATE_VARIANTS", "smem,rs2,rs3").split(",")
    for op in ("gdn", "kda"):
        kda = op == "kda"
        for B, H, T, n in [(1, 4, 8192, 1), (1, 4, 16384, 9), (2, 16, 8192, 1), (8, 4, 16384, 1)]:
            x = ops.make_inputs(op, B, H, T, torch.bfloat16, "cuda")
            prep = two_phase.chunk_prep(x["q"], x["k"], x["v"], x["g"], x["beta"], kda=kda).gated()
            chunks = -(-T // 64)
            line = []
            outs = []
            for name in variants:
                two_phase.STATE_PASS_RS = name.startswith("rs")
                two_phase.STATE_STAGES = int(name[2]) if name.startswith("rs") else 2
                t = graph_us(lambda: two_phase.state_pass(prep, None, True, num_segments=n))
                outs.append(two_phase.state_pass(prep, None, True, num_segments=n)[0])
                line.append(f"{name} {t:.1f} us ({t / chunks * n:.2f}/chunk)")
            two_phase.STATE_PASS_RS, two_phase.STATE_STAGES = True, 2
            same = all(torch.equal(outs[0], y) for y in outs[1:])
            print(f"{op} state pass B={B} H={H} T={T} N={n}: " + " | ".join(line) + f" | bitwise equal {same}",
                  flush=True)


def time_chain():
    """Where the state pass's time per chunk goes (the rs consumer's `profile` build): clock64 cycles per phase,
    summed over every CTA's chunks (unsplit forward, 2 CTAs per (sequence, head)), next to the plain builds' times:
    "direct" (exp(G_last) read by the consumer, o stored from registers), "ring" (exp(G_last) in the ring stage),
    "ring+o" (and o tiles by TMA store), "ring+ufast" (u read at constant offsets). The plain builds' o must be
    bitwise equal."""
    variants = {"direct": (False, False, False), "ring": (True, False, False), "ring+o": (True, True, False),
                "ring+ufast": (True, False, True)}
    for op in ("gdn", "kda"):
        kda = op == "kda"
        for B, H, T in [(1, 4, 8192), (2, 16, 8192), (1, 3, 1000)]:
            x = ops.make_inputs(op, B, H, T, torch.bfloat16, "cuda")
            prep = two_phase.chunk_prep(x["q"], x["k"], x["v"], x["g"], x["beta"], kda=kda).gated()
            schedule, _ = two_phase._state_pass_schedules(B, T, H, 128, 1, False, None, prep.u.device)
            launch = ((schedule.table_on(prep.u.device), schedule.num_tiles, schedule.grid[0])
                      + two_phase.state_pass_tail(prep.u.device, prep.u.dtype))
            dummy = torch.empty((1, 1, 128, 128), dtype=torch.float32, device="cuda")
            terms = (prep.qg, prep.w, prep.u, prep.kg, prep.aqk, prep.eg)
            line, outs = [], []
            for name, (td, to, uf) in variants.items():
                plain = two_phase.compile_state_pass(torch.bfloat16, kda, False, False, rs=True,
                                                     ring_decay=td, tma_o=to, u_fast=uf).fn
                o = torch.full_like(prep.u, float("nan"))
                t_plain = graph_us(lambda: plain(*terms, o, dummy, dummy, *launch))
                o = torch.full_like(prep.u, float("nan"))
                plain(*terms, o, dummy, dummy, *launch)
                outs.append(o)
                line.append(f"{name} {t_plain:.1f} us ({t_plain / (-(-T // 64)):.2f}/chunk)")
            same = all(torch.equal(outs[0], y) for y in outs[1:]) and not outs[0].isnan().any()
            print(f"{op} state pass B={B} H={H} T={T}: " + " | ".join(line) + f" | bitwise equal, no NaN: {same}",
                  flush=True)
            if T < 4096:
                continue
            for name in ("ring", "ring+ufast"):
                td, to, uf = variants[name]
                fn = two_phase.compile_state_pass(torch.bfloat16, kda, False, False, rs=True, profile=True,
                                                  ring_decay=td, tma_o=to, u_fast=uf).fn
                t_prof, per_chunk_us, cyc = chain_profile(fn, terms, prep.u, launch)
                total = sum(cyc)
                print(f"  profile {name}: {t_prof:.1f} us ({per_chunk_us:.2f} us/chunk, {total:.0f} cycles/chunk -> "
                      f"{total / per_chunk_us / 1e3:.2f} GHz) | cycles per chunk: wait+eg {cyc[0]:.0f}, products 1 "
                      f"{cyc[1]:.0f}, v_new (sub+cvt) {cyc[2]:.0f}, issue 2+o wait+o stores {cyc[3]:.0f}, "
                      f"update wait+release {cyc[4]:.0f}", flush=True)


def chain_profile(fn, terms, u, launch):
    """Run a state-pass profile build (`fn`, its tile table `launch`): (GPU time, us per chunk along a CTA's chain,
    cycles per chunk of its phases [wait, products 1, v_new, issue 2 + o, update wait + release])."""
    grid = launch[2]
    dummy = torch.empty((1, 1, 128, 128), dtype=torch.float32, device="cuda")
    stamps = torch.zeros((1, 1, 128, 128), dtype=torch.float32, device="cuda")
    o = torch.empty_like(u)
    t_prof = graph_us(lambda: fn(*terms, o, dummy, stamps, *launch))
    stamps.zero_()
    fn(*terms, o, dummy, stamps, *launch)
    torch.cuda.synchronize()
    p = stamps.flatten()[: 8 * grid].view(grid, 8).double()
    chunks = p[:, 4].sum().item()
    return t_prof, t_prof / (chunks / grid), (p[:, [0, 1, 2, 5, 3]].sum(0) / chunks).tolist()


def time_prep_profile():
    """Phase 1 (GDN slim, two CTAs per SM; KDA one per SM): its time, then the profile build's cycles per chunk by
    step (consumer thread 0 of each CTA) and the CTAs' average lifetime per chunk. PREP_CPT=1,2,4 sets the chunks
    per tile tried; PREP_PROFILE_OPS=gdn,kda the ops; KDA runs each of PREP_FORMS=rows,columns (its Akk / Aqk
    form, `row_anchors`)."""
    from schedulers import Segmentation, schedule_from_segmentation, split_even

    cpts = [int(c) for c in os.environ.get("PREP_CPT", "2").split(",")]
    names = ["gates", "qkv wait", "Akk/Aqk", "qg/kg stores", "solve", "w/u products", "stores+release"]
    for op in os.environ.get("PREP_PROFILE_OPS", "gdn,kda").split(","):
        kda = op == "kda"
        for B, H, T in [(1, 4, 16384), (2, 16, 8192)]:
            x = ops.make_inputs(op, B, H, T, torch.bfloat16, "cuda")
            args = (x["q"], x["k"], x["v"], x["g"].float(), x["beta"])
            chunks = -(-T // 64)
            problem = two_phase._problem(B, T, H, None)
            forms = os.environ.get("PREP_FORMS", "rows,columns").split(",") if kda else ["-"]
            for cpt, form in [(c, f) for c in cpts for f in forms]:
                ra = None if form == "-" else form == "rows"
                seg = Segmentation([split_even(c, max(1, -(-c // cpt))) for c in problem.chunks])
                sch = schedule_from_segmentation(problem, seg, "prep")
                launch = (sch.table_on(x["q"].device), sch.num_tiles, sch.grid[0])
                plan = two_phase.PrepPlan(B, T, H, None, kda, torch.bfloat16, x["beta"].dtype, x["q"].device, cpt)
                slots = 132 * plan.occupancy   # CTAs per SM: 3 with PREP_TRIO's build on a large grid
                trio = plan.occupancy == 3
                t = plan.allocate(torch.bfloat16)
                if t.raw:   # GDN_RAW_QK: the kernel takes q, k in the qg, kg places (and writes neither)
                    t = dataclasses.replace(t, qg=x["q"], kg=x["k"])
                terms = (t.qg, t.w, t.u, t.kg, t.aqk, t.eg)
                fn = two_phase.compile_chunk_prep(torch.bfloat16, x["beta"].dtype, kda, row_anchors=ra, trio=trio).fn
                flags = two_phase.no_flags(x["q"].device)
                us = graph_us(lambda: fn(*args, *terms, *launch, 128 ** -0.5, *flags))
                print(f"{op} prep {form} B={B} H={H} T={T} chunks/tile {cpt} ({sch.num_tiles} CTAs): {us:.1f} us "
                      f"({us * slots / (B * H * chunks):.2f} us/chunk/CTA)", flush=True)
                fn = two_phase.compile_chunk_prep(torch.bfloat16, x["beta"].dtype, kda, profile=True,
                                                  row_anchors=ra, trio=trio).fn
                t.eg.zero_()
                fn(*args, *terms, *launch, 128 ** -0.5, *flags)
                torch.cuda.synchronize()
                n = sch.num_tiles
                p = t.eg.flatten()[: 16 * n].view(n, 16).double()
                nch = p[:, 7].sum().item()
                cyc = (p[:, :7].sum(0) / nch).tolist()
                life = (p[:, 8].sum() / nch).item()
                sub = (p[:, 9:11].sum(0) / nch).tolist()   # row_anchors: step 2's factor pass, band products
                sol = (p[:, 11:15].sum(0) / nch).tolist()   # the solve's level 0, level 16, level 32, stores
                print("  profile, cycles per chunk: " + ", ".join(f"{a} {b:.0f}" for a, b in zip(names, cyc))
                      + f" | sum {sum(cyc) + sum(sub) + sum(sol):.0f}, CTA lifetime per chunk {life:.0f}"
                      + f" | solve parts: level 0 {sol[0]:.0f}, level 16 {sol[1]:.0f}, level 32 {sol[2]:.0f}, "
                        f"16-bit stores {sol[3]:.0f}, fence+barrier {cyc[4]:.0f}"
                      + (f" | Akk/Aqk parts: factor pass {sub[0]:.0f}, band products {sub[1]:.0f}, rest {cyc[2]:.0f}"
                         if ra else ""), flush=True)


def time_paths():
    """Large B x H: the fused forward against the two-phase path (both forced), GDN and KDA, FLA beside -- the
    cells where the cost models decide between them (PATH_CELLS=B,H,T;B,H,T overrides; PATH_OPS=gdn,kda)."""
    cells = env_cells("PATH_CELLS", "16,64,4096;4,32,4096")
    for op in os.environ.get("PATH_OPS", "gdn,kda").split(","):
        _, peer = ops.load_peer(op)
        ours, _ = ops.load_ours(op)
        for B, H, T in cells:
            x = ops.make_inputs(op, B, H, T, torch.bfloat16, "cuda")
            res = {}
            for name, mode in (("fused", "0"), ("two-phase", "1")):
                la.TWO_PHASE = mode
                res[name] = graph_us(lambda: ops.call_ours(op, ours, x), calls=3, reps=3)
            la.TWO_PHASE = "auto"
            ops.call_ours(op, ours, x)
            auto = "two-phase" if la._last_choice and la._last_choice[1] else "fused"
            tf = graph_us(lambda: peer(x), calls=3, reps=3)
            chunks = B * H * -(-T // 64)
            print(f"{op} B={B} H={H} T={T}: fused {res['fused']:.0f} us ({res['fused'] * 132 / chunks:.2f} us/chunk "
                  f"per SM) | two-phase {res['two-phase']:.0f} us | FLA {tf:.0f} us | auto picks {auto}", flush=True)


def time_pair():
    """Phase 2 with `pair` tiles (both V blocks of a (sequence, head, segment) in one CTA, two consumer warpgroups
    on one ring) against one V block per CTA, per segment count: GPU time, us per chunk along a segment's chain,
    bitwise equality of o and the final state (each consumer runs the same math); then the whole op ("auto") with
    STATE_PAIR off and on, and the segment count its planner picked. PAIR_OPS=gdn,kda picks the ops."""
    cells = [(1, 4, 16384, (1, 9, 16)), (1, 16, 4096, (1, 3, 6)), (2, 16, 8192, (1, 3)), (4, 16, 8192, (1,)),
             (8, 16, 4096, (1,))]
    ops_ = os.environ.get("PAIR_OPS", "gdn,kda").split(",")
    if os.environ.get("PAIR_PROFILE", "0") == "1":
        return pair_profile()
    for op in ops_:
        kda = op == "kda"
        for B, H, T, ns in cells:
            x = ops.make_inputs(op, B, H, T, torch.bfloat16, "cuda")
            prep = two_phase.chunk_prep(x["q"], x["k"], x["v"], x["g"], x["beta"], kda=kda).gated()
            chunks = -(-T // 64)
            for n in ns:
                line, outs = [], []
                for name, pair in (("one block", "0"), ("pair", "1")):
                    two_phase.STATE_PAIR = pair
                    t = graph_us(lambda: two_phase.state_pass(prep, None, True, num_segments=n))
                    o, s = two_phase.state_pass(prep, None, True, num_segments=n)
                    outs.append((o.clone(), s.clone()))
                    line.append(f"{name} {t:.1f} us ({t / chunks * n:.2f}/chunk)")
                two_phase.STATE_PAIR = "0"
                same = all(torch.equal(a, b) for x in outs[1:] for a, b in zip(outs[0], x))
                nan = any(y.isnan().any().item() for x in outs for y in x)
                print(f"{op} state pass B={B} H={H} T={T} N={n}: " + " | ".join(line)
                      + f" | bitwise equal {same}, NaN {nan}", flush=True)
    for op in ops_:
        ours, _ = ops.load_ours(op)
        for B, H, T, _ in cells:
            x = ops.make_inputs(op, B, H, T, torch.bfloat16, "cuda")
            line = []
            for pair in ("0", "1"):
                two_phase.STATE_PAIR = pair
                t = graph_us(lambda: ops.call_ours(op, ours, x), calls=3, reps=3)
                plan = la.last_plan() if hasattr(la, "last_plan") else None
                line.append(f"{'pair' if pair == '1' else 'one block'} {t:.1f} us ({plan})")
            two_phase.STATE_PAIR = "0"
            print(f"{op} op B={B} H={H} T={T}: " + " | ".join(line), flush=True)


def time_pair_auto():
    """STATE_PAIR "auto" on multi-wave state passes, with the default phase-1 terms (GDN: GDN_FOLD's): the state
    pass alone, unsplit, one-block tiles against `pair` tiles (graph replay; o and the final state must be bitwise
    equal: each consumer runs the same math), then the op under STATE_PAIR "0" and "auto" beside FLA.
    PAIR_AUTO_CELLS="B,H,T;..." picks the cells, PAIR_AUTO_OPS=gdn,kda the ops."""
    cells = env_cells("PAIR_AUTO_CELLS", "16,64,4096;8,32,4096;8,16,4096;4,64,16384")
    ops_ = os.environ.get("PAIR_AUTO_OPS", "gdn,kda").split(",")
    for op, (B, H, T), prep in cell_preps(ops_, cells):
        line = compare_state_builds(prep, "STATE_PAIR", (("one block", "0"), ("pair", "1")))
        print(f"{op} state pass B={B} H={H} T={T} ({'fold' if prep.fold else 'raw' if prep.raw else 'gated'}"
              f" terms): {line}", flush=True)
    default = two_phase.STATE_PAIR
    settings = [(label, lambda p=p: setattr(two_phase, "STATE_PAIR", p)) for label, p in (("one block", "0"),
                                                                                         ("auto", "auto"))]
    time_op_settings(ops_, cells, settings, lambda: setattr(two_phase, "STATE_PAIR", default))


def time_lookback():
    """STATE_LOOKBACK: the segmented state pass in one launch against the split launches (summary, merge, segment
    outputs), the state pass alone at several segment counts (graph replay; o and the final state must be
    bitwise equal), then the op (its own segment count) under both beside FLA. LOOKBACK_CELLS="B,H,T;..." and
    LOOKBACK_SEGMENTS="4,9,16" pick the cells and the counts, LOOKBACK_OPS=gdn,kda the ops."""
    cells = env_cells("LOOKBACK_CELLS", "1,4,16384;1,16,4096;2,16,2048")
    counts = [int(n) for n in os.environ.get("LOOKBACK_SEGMENTS", "4,9,16").split(",")]
    ops_ = os.environ.get("LOOKBACK_OPS", "gdn,kda").split(",")
    for op, (B, H, T), prep in cell_preps(ops_, cells):
        for n in counts:
            line = compare_state_builds(prep, "STATE_LOOKBACK", (("split", False), ("lookback", True)),
                                        num_segments=n)
            print(f"{op} state pass B={B} H={H} T={T} N={n}: {line}", flush=True)
    default = two_phase.STATE_LOOKBACK
    settings = [(label, lambda v=v: setattr(two_phase, "STATE_LOOKBACK", v)) for label, v in (("split", False),
                                                                                           ("lookback", True))]
    time_op_settings(ops_, cells, settings, lambda: setattr(two_phase, "STATE_LOOKBACK", default))


def time_one_pass():
    """STATE_ONE_PASS: the one-pass segmented state pass (summaries with the chains' outputs, merge, correction)
    against the split launches and the look-back launch, and with STATE_EARLY_CORRECTION (the correction spinning
    on the merge's published start states), the state pass alone at several segment counts (graph replay;
    one-pass is not bitwise the split path's -- its outputs are o0 + qm S_0 --, so the relative difference is
    printed), then the op under each beside FLA. ONE_PASS_CELLS / ONE_PASS_SEGMENTS / ONE_PASS_OPS as LOOKBACK_*;
    ONE_PASS_MODES=split,lookback,one-pass,early picks the builds."""
    cells = env_cells("ONE_PASS_CELLS", "1,4,16384;1,16,4096;2,16,2048")
    counts = [int(n) for n in os.environ.get("ONE_PASS_SEGMENTS", "4,8,16").split(",")]
    ops_ = os.environ.get("ONE_PASS_OPS", "gdn,kda").split(",")
    picked = os.environ.get("ONE_PASS_MODES", "split,lookback,one-pass,early").split(",")
    modes = [m for m in (("split", False, False, False), ("lookback", True, False, False),
                         ("one-pass", False, True, False), ("early", False, True, True)) if m[0] in picked]

    def setting(lookback, one_pass, early):
        two_phase.STATE_LOOKBACK, two_phase.STATE_ONE_PASS = lookback, one_pass
        two_phase.STATE_EARLY_CORRECTION = early

    default = (two_phase.STATE_LOOKBACK, two_phase.STATE_ONE_PASS, two_phase.STATE_EARLY_CORRECTION)
    for op, (B, H, T), prep in cell_preps(ops_, cells):
        for n in counts:
            line = compare_state_builds(prep, None, [(m[0], m[1:]) for m in modes], num_segments=n,
                                        set_fn=lambda v: setting(*v))
            setting(*default)
            print(f"{op} state pass B={B} H={H} T={T} N={n}: {line}", flush=True)
    settings = [(m[0], lambda v=m[1:]: setting(*v)) for m in modes]
    time_op_settings(ops_, cells, settings, lambda: setting(*default))


def cell_preps(ops_, cells):
    """(op, (B, H, T), phase 1's terms on the GPU with the default switches) for each op and cell."""
    for op in ops_:
        for B, H, T in cells:
            x = ops.make_inputs(op, B, H, T, torch.bfloat16, "cuda")
            yield op, (B, H, T), two_phase.chunk_prep(x["q"], x["k"], x["v"], x["g"], x["beta"], kda=op == "kda")


def compare_state_builds(prep, switch: str | None, choices, set_fn=None, **kw) -> str:
    """The state pass on `prep` (no initial state, final state stored, `kw` to `state_pass`) under each (label,
    value) of the module switch `two_phase.<switch>` (or `set_fn(value)`, the caller restoring): its graph-replay
    time, and whether o and the final state are bitwise equal across the choices (else their largest relative
    difference from the first) and free of NaN. The switch is restored."""
    default = getattr(two_phase, switch) if switch else None
    line, outs = [], []
    for name, value in choices:
        if set_fn is not None:
            set_fn(value)
        else:
            setattr(two_phase, switch, value)
        t = graph_us(lambda: two_phase.state_pass(prep, None, True, **kw), calls=3, reps=3)
        o, s = two_phase.state_pass(prep, None, True, **kw)
        outs.append((o.clone(), s.clone()))
        line.append(f"{name} {t:.1f} us")
    if switch:
        setattr(two_phase, switch, default)
    same = all(torch.equal(a, b) for y in outs[1:] for a, b in zip(outs[0], y))
    nan = any(y.isnan().any().item() for x in outs for y in x)
    diff = max(((a.float() - b.float()).norm() / b.float().norm()).item() for y in outs[1:] for a, b in zip(y, outs[0]))
    return " | ".join(line) + f" | bitwise equal {same} (rel. diff {diff:.1e}), NaN {nan}"


def pair_profile():
    """The rs consumer's cycles per chunk by phase (profile build, consumer 0 of each CTA) with one chain per CTA,
    two (`pair`): GDN, unsplit forward."""
    for B, H, T in [(1, 4, 8192), (2, 16, 8192)]:
        x = ops.make_inputs("gdn", B, H, T, torch.bfloat16, "cuda")
        prep = two_phase.chunk_prep(x["q"], x["k"], x["v"], x["g"], x["beta"], kda=False).gated()
        terms = (prep.qg, prep.w, prep.u, prep.kg, prep.aqk, prep.eg)
        for name, pair in (("one block", False), ("pair", True)):
            schedule, _ = two_phase._state_pass_schedules(B, T, H, 128, 1, False, None, prep.u.device, pair)
            launch = ((schedule.table_on(prep.u.device), schedule.num_tiles, schedule.grid[0])
                      + two_phase.state_pass_tail(prep.u.device, prep.u.dtype))
            fn = two_phase.compile_state_pass(torch.bfloat16, False, False, False, rs=True, profile=True,
                                              ring_decay=True, tma_o=False, u_fast=False, pair=pair).fn
            t_prof, per_chunk, cyc = chain_profile(fn, terms, prep.u, launch)
            print(f"gdn profile B={B} H={H} T={T} {name}: {t_prof:.1f} us ({per_chunk:.2f} us/chunk) "
                  f"| cycles per chunk: wait {cyc[0]:.0f}, products 1 {cyc[1]:.0f}, v_new {cyc[2]:.0f}, issue 2 + o "
                  f"{cyc[3]:.0f}, update wait + release {cyc[4]:.0f} (sum {sum(cyc):.0f})", flush=True)


def planned_segments():
    """The segment count of the op's last call, from its plan (`last_plan()`; benchmarks.report's parser)."""
    from benchmarks import report

    n = report.segments({"extra": {"plan": la.last_plan() or ""}})
    return "?" if n is None else int(n)


def time_pdl():
    """The op ("auto" path) with programmatic dependent launch between the two-phase kernels off and on
    (`two_phase.PDL`): GPU time from graph replay and bitwise equality of o and the final state (same kernels, only
    the launch overlap differs). PDL_OPS=gdn,kda picks the ops."""
    cells = [(1, 4, 512), (1, 4, 1024), (1, 4, 4096), (1, 4, 16384), (1, 16, 2048), (2, 16, 8192)]
    for op in os.environ.get("PDL_OPS", "gdn").split(","):
        ours, _ = ops.load_ours(op)
        for B, H, T in cells:
            x = ops.make_inputs(op, B, H, T, torch.bfloat16, "cuda")
            line, outs = [], []
            for pdl in (False, True):
                two_phase.PDL = pdl
                t = graph_us(lambda: ops.call_ours(op, ours, x), calls=5, reps=5)
                for _ in range(3 if pdl else 1):   # PDL on: three eager calls, each must equal the PDL-off one
                    outs.append(tuple(y.clone() for y in ops.call_ours(op, ours, x) if y is not None))
                line.append(f"PDL {'on' if pdl else 'off'} {t:.1f} us")
            two_phase.PDL = False
            same = all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))
            nan = any(y.isnan().any().item() for o in outs for y in o)
            plan = la.last_plan() or ""
            n = planned_segments()
            path = "two-phase" if "path: two-phase" in plan else "fused"
            print(f"{op} op B={B} H={H} T={T} ({path}, N={n}): " + " | ".join(line)
                  + f" | bitwise equal {same}, NaN {nan}", flush=True)


def time_op_settings(op_names, cells, settings, restore, extra=None):
    """The op (scheduler=None) under each of `settings` ((label, set) pairs: `set()` switches a module setting
    before the call; `restore()` undoes it after each), FLA in the same run: GPU time from graph replay, the
    plan's segment count, max relative error against FLA, NaN; `extra(op, B, H, T)` may add a last field."""
    for op in op_names:
        ours, _ = ops.load_ours(op)
        _, peer = ops.load_peer(op)
        for B, H, T in cells:
            x = ops.make_inputs(op, B, H, T, torch.bfloat16, "cuda")
            want = peer(x)
            tf = graph_us(lambda: peer(x), calls=5, reps=5)
            line = [f"FLA {tf:.1f} us"]
            for label, set_it in settings:
                set_it()
                try:
                    got = ops.call_ours(op, ours, x)
                    n = planned_segments()
                    t = graph_us(lambda: ops.call_ours(op, ours, x), calls=5, reps=5)
                finally:
                    restore()
                nan = any(y.isnan().any().item() for y in ops.output_tensors(got) if y is not None)
                line.append(f"{label} N={n} {t:.1f} us ({tf / t:.2f}x, err {ops.max_rel_err(got, want):.1e}, NaN {nan})")
            if extra is not None:
                line.append(extra(op, B, H, T))
            print(f"{op} op B={B} H={H} T={T}: " + " | ".join(line), flush=True)


def time_merge():
    """The op ("auto" path, its own segment count for each merge variant's link cost) with the affine merge forced
    to each of MERGE_IMPLS (default prefetch,regs), FLA in the same run: GPU time from graph replay, the segment
    count chosen, max relative error against FLA, NaN. MERGE_OPS=gdn,kda picks the ops."""
    from cute_kernels.ops import merge as merge_ops

    cells = [(1, 4, 2048), (1, 4, 4096), (1, 4, 8192), (1, 4, 16384), (1, 8, 8192), (2, 4, 16384), (1, 16, 4096)]
    impls = os.environ.get("MERGE_IMPLS", "prefetch,regs").split(",")
    settings = [(impl, lambda impl=impl: setattr(merge_ops, "AFFINE_MERGE_IMPL", impl)) for impl in impls]
    time_op_settings(os.environ.get("MERGE_OPS", "gdn,kda").split(","), cells, settings,
                     lambda: setattr(merge_ops, "AFFINE_MERGE_IMPL", "auto"))


def kernel_times(fn, reps: int = 5) -> list[tuple[str, float]]:
    """(kernel name, GPU us per call) of every kernel `fn` launches, in launch order (torch.profiler / CUPTI over
    `reps` eager calls after a warm-up; names shortened to their distinctive part)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}   # full kernel name -> us per call (the summary and output launches differ)
    for e in prof.events():
        if e.device_type.name != "CUDA" or "memcpy" in e.name.lower() or "memset" in e.name.lower():
            continue
        totals[e.name] = totals.get(e.name, 0.0) + e.device_time / reps
    short = []
    for name, us in totals.items():
        for marker in ("ChunkPrep", "ChunkStatePass", "Merge", "merge", "chunk", "kernel"):
            if marker in name:
                name = name[name.index(marker):]
                break
        short.append((name[:40], us))
    return short


def time_phases():
    """Where the op's GPU time goes, per kernel, at forced segment counts (PHASE_NS, default 1,4,8) for GDN and KDA
    (PHASE_OPS) and cells (PHASE_CELLS, BxHxT): the two-phase path, each kernel's GPU time per call from the profiler, their sum, and the graph-
    replay time of the whole call. Explains the per-segment cost the path model charges (SEGMENT_US)."""
    from schedulers import SegmentScheduler

    cells = [tuple(int(v) for v in c.split("x")) for c in os.environ.get("PHASE_CELLS", "1x4x2048,1x4x8192").split(",")]
    ns = [int(n) for n in os.environ.get("PHASE_NS", "1,4,8").split(",")]
    two_phase.PDL = os.environ.get("PHASE_PDL", "0") == "1"   # PDL on: a kernel's time includes its wait
    for op in os.environ.get("PHASE_OPS", "gdn,kda").split(","):
        ours, _ = ops.load_ours(op)
        for B, H, T in cells:
            x = ops.make_inputs(op, B, H, T, torch.bfloat16, "cuda")
            for n in ns:
                sched = SegmentScheduler(num_segments=n)
                call = lambda: ours(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True,  # noqa: E731
                                    scheduler=sched)
                la.TWO_PHASE = "1"
                try:
                    t = graph_us(call, calls=5, reps=5)
                    parts = kernel_times(call)
                finally:
                    la.TWO_PHASE = "auto"
                total = sum(us for _, us in parts)
                print(f"{op} B={B} H={H} T={T} N={n}: graph {t:.1f} us, kernels {total:.1f} us = "
                      + " + ".join(f"{name} {us:.1f}" for name, us in parts), flush=True)


def time_overlap():
    """The op (scheduler=None) with the overlapped path off (its usual plan) and forced (CUTE_KERNELS_OVERLAP=1),
    FLA in the same run: GPU time from graph replay, the plan's segment count, max relative error against FLA,
    NaN, and the model's prediction. OVERLAP_OPS=gdn,kda picks the ops, OVERLAP_CELLS="B,H,T;..." the cells."""
    from schedulers import Problem

    cells = env_cells("OVERLAP_CELLS", "1,16,2048;1,16,4096;1,16,8192;2,8,4096;1,8,8192;4,4,8192")
    raw_default, fold_default, share_default = two_phase.OVERLAP_RAW, two_phase.OVERLAP_FOLD, two_phase.OVERLAP_SHARE

    def setting(overlap, raw, fold=False, share="0"):
        la.OVERLAP, two_phase.OVERLAP_RAW, two_phase.OVERLAP_FOLD = overlap, raw, fold
        two_phase.OVERLAP_SHARE = share

    # GDN's overlapped path in its three builds (gated: phase 1 one CTA per SM; raw, OVERLAP_RAW: three per SM;
    # share, OVERLAP_SHARE: and one beside each state CTA); KDA's gated build with and without KDA_FOLD's phase 1
    # (OVERLAP_FOLD). OVERLAP_SETTINGS picks them by label.
    settings = [("plain", lambda: setting("0", raw_default, fold_default, share_default)),
                ("overlap gated", lambda: setting("1", False)), ("overlap raw", lambda: setting("1", True)),
                ("overlap fold", lambda: setting("1", False, True)),
                ("overlap share", lambda: setting("1", False, False, "1"))]
    wanted = os.environ.get("OVERLAP_SETTINGS", "plain,overlap gated,overlap raw").split(",")
    settings = [s for s in settings if s[0] in wanted]

    def model(op, B, H, T):
        out = []
        builds = ((("gated", False, False, "0"), ("fold", False, True, "0")) if op == "kda" else
                  (("gated", False, False, "0"), ("raw", True, False, "0"), ("share", False, False, "1")))
        for label, raw, fold, share in builds:
            setting("auto", raw, fold, share)
            us = two_phase.predicted_overlap_us(Problem.fixed(B, T, H), op == "kda", 132)
            out.append(f"model overlap {label} {us:.0f} us")
        setting("auto", raw_default, fold_default, share_default)
        return ", ".join(out)

    time_op_settings(os.environ.get("OVERLAP_OPS", "gdn,kda").split(","), cells, settings,
                     lambda: setting("auto", raw_default, fold_default, share_default), model)

def prep_ab(op, cells, setting, labels, chunks_per_tile=None, slots_per_sm=None, values=(False, True)):
    """Phase 1 alone (graph replay) with the module setting `two_phase.<setting>` off, then on (`values`), per cell
    (the same tiles when `chunks_per_tile` is given); `slots_per_sm` (off, on) adds us per chunk per CTA at that
    occupancy."""
    default = getattr(two_phase, setting)
    kda = op == "kda"
    for B, H, T in cells:
        x = ops.make_inputs(op, B, H, T, torch.bfloat16, "cuda")
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        line = []
        for on in (False, True):
            setattr(two_phase, setting, values[on])
            t = graph_us(lambda: two_phase.chunk_prep(*args, kda=kda, chunks_per_tile=chunks_per_tile))
            per = (f" ({t * 132 * slots_per_sm[on] / (B * H * -(-T // 64)):.2f} us/chunk/CTA)" if slots_per_sm
                   else "")
            line.append(f"{labels[on]} {t:.1f} us{per}")
        setattr(two_phase, setting, default)
        tiles = f" ({chunks_per_tile} chunks per tile)" if chunks_per_tile else ""
        print(f"{op} prep B={B} H={H} T={T}{tiles}: " + " | ".join(line), flush=True)


def op_ab(op_names, cells, setting, labels, values=(False, True)):
    """The op beside FLA (`time_op_settings`) with the module setting `two_phase.<setting>` off, then on
    (`values`)."""
    default = getattr(two_phase, setting)
    settings = [(labels[on], lambda on=on: setattr(two_phase, setting, values[on])) for on in (False, True)]
    time_op_settings(op_names, cells, settings, lambda: setattr(two_phase, setting, default))


def time_raw():
    """GDN_RAW_QK off ("gated": phase 1 writes qg, kg) and on ("raw": the state pass reads q, k): phase 1 alone
    (slim, graph replay), then the op beside FLA (`time_op_settings`). RAW_CELLS="B,H,T;..." picks the cells."""
    cells = env_cells("RAW_CELLS", "1,4,4096;1,4,16384;1,16,2048;2,16,8192")
    prep_ab("gdn", cells, "GDN_RAW_QK", ("gated", "raw"))
    op_ab(["gdn"], cells, "GDN_RAW_QK", ("gated", "raw"))


def time_kda_stages():
    """KDA_FOLD's phase 1 with one q / k stage against two (KDA_PREP_STAGES 1 / 2): phase 1 alone (graph replay;
    the plan's tiles, then two-chunk tiles), then the op beside FLA under both. STAGES_CELLS="B,H,T;..." picks the
    cells. Prediction (session 29): phase 1 -5..-8% (the step-1 wait, ~1.9k of ~25k cycles per chunk, mostly
    hidden), the op -3..-5% where phase 1 is most of it. Outcome (H200): phase 1 -2% at B=16 H=64 T=4096, +0..2%
    at the others, the op within +-2%."""
    cells = env_cells("STAGES_CELLS", "1,4,16384;2,16,8192;2,16,1024;16,64,4096")
    for cpt in (None, 2):
        prep_ab("kda", cells, "KDA_PREP_STAGES", ("1 stage", "2 stages"), chunks_per_tile=cpt, values=(1, 2))
    op_ab(["kda"], cells, "KDA_PREP_STAGES", ("1 stage", "2 stages"), values=(1, 2))


def time_trio():
    """GDN's phase 1 (raw build) with two CTAs per SM against three (PREP_TRIO), the same tiles (two chunks each):
    graph-replay time, us per chunk per CTA at its own occupancy; then the op beside FLA under both settings
    (each plans with its own slots per SM). TRIO_CELLS="B,H,T;..." picks the cells."""
    cells = env_cells("TRIO_CELLS", "1,4,4096;1,4,16384;1,16,2048;2,16,8192;8,8,4096")
    prep_ab("gdn", cells, "PREP_TRIO", ("slim", "trio"), chunks_per_tile=2, slots_per_sm=(2, 3))
    op_ab(["gdn"], cells, "PREP_TRIO", ("slim", "trio"))


def time_solve_mma():
    """Phase 1 with its solve's doubling levels on the CUDA cores against tf32 mma.sync (PREP_SOLVE_MMA), GDN (raw,
    trio on large grids) and KDA (row-anchored): graph-replay time of phase 1 alone on the same tiles, then the op
    beside FLA under both. MMA_CELLS="B,H,T;..." picks the cells, MMA_OPS=gdn,kda the ops."""
    cells = env_cells("MMA_CELLS", "1,4,16384;2,16,8192;8,8,4096")
    ops_ = os.environ.get("MMA_OPS", "gdn,kda").split(",")
    for op in ops_:
        prep_ab(op, cells, "PREP_SOLVE_MMA", ("cuda cores", "mma"), chunks_per_tile=2)
    op_ab(ops_, cells, "PREP_SOLVE_MMA", ("cuda cores", "mma"))


def time_balance():
    """GDN phase 1 on two-chunk tiles against PREP_BALANCE's one wave of 2-3 chunk tiles (the plan picks the tiles:
    `prep_tile_counts`), then the op beside FLA under both. BAL_CELLS="B,H,T;..." picks the cells (default: the
    seed cells with 1024 chunk rows, where the model predicts 3 chunk times per slot instead of 4); BAL_OP=0 skips
    the op (and FLA's autotuning)."""
    cells = env_cells("BAL_CELLS", "1,4,16384;1,16,4096;2,16,2048;8,16,512")
    prep_ab("gdn", cells, "PREP_BALANCE", ("two-chunk tiles", "balanced"))
    if os.environ.get("BAL_OP", "1") == "1":
        op_ab(["gdn"], cells, "PREP_BALANCE", ("two-chunk tiles", "balanced"))


def time_fold():
    """GDN's phase 1 writing w and u against GDN_FOLD's W2 and A1 (graph replay, the plan's own tiles), then the op
    beside FLA under both. FOLD_CELLS="B,H,T;..." picks the cells; FOLD_PREP=0 skips phase 1 alone."""
    cells = env_cells("FOLD_CELLS", "16,64,4096;8,32,4096;2,16,8192;1,4,16384")
    if os.environ.get("FOLD_PREP", "1") == "1":
        prep_ab("gdn", cells, "GDN_FOLD", ("w, u", "fold"))
    op_ab(["gdn"], cells, "GDN_FOLD", ("w, u", "fold"))


def time_kda_fold():
    """KDA's phase 1 writing w, u, kg, Aqk against KDA_FOLD's exp(G) k, W2 and A1 (no v load, no u; graph replay,
    the plan's own tiles), then the op beside FLA under both. KDA_FOLD_CELLS="B,H,T;..." picks the cells;
    FOLD_PREP=0 skips phase 1 alone."""
    cells = env_cells("KDA_FOLD_CELLS", "16,64,4096;8,32,4096;2,16,8192;1,4,16384")
    if os.environ.get("FOLD_PREP", "1") == "1":
        prep_ab("kda", cells, "KDA_FOLD", ("w, u", "fold"))
    op_ab(["kda"], cells, "KDA_FOLD", ("w, u", "fold"))


def time_fold_chain():
    """GDN's raw state pass reading w, u against GDN_FOLD's (k, v, W2, A1): unsplit forward, plain
    build time (graph replay, us per chunk per CTA) and the profile build's cycles per chunk by phase, with o stored
    from registers and (FOLD_TMA_O=1) by TMA from shared memory. FOLD_CHAIN_CELLS="B,H,T;..." picks the cells."""
    cells = env_cells("FOLD_CHAIN_CELLS", "2,16,8192;16,64,1024")
    tma_os = (False, True) if os.environ.get("FOLD_TMA_O", "0") == "1" else (False,)
    for B, H, T in cells:
        x = ops.make_inputs("gdn", B, H, T, torch.bfloat16, "cuda")
        schedule, _ = two_phase._state_pass_schedules(B, T, H, 128, 1, False, None, x["q"].device)
        launch = (schedule.table_on(x["q"].device), schedule.num_tiles, schedule.grid[0])
        dummy = torch.empty((1, 1, 128, 128), dtype=torch.float32, device="cuda")
        flags = two_phase.state_pass_tail(x["q"].device, torch.bfloat16)
        for fold in (False, True):
            two_phase.GDN_FOLD = fold
            prep = two_phase.chunk_prep(x["q"], x["k"], x["v"], x["g"], x["beta"], kda=False)
            two_phase.GDN_FOLD = False
            terms = (prep.qg, prep.w, prep.u, prep.kg, prep.aqk, prep.eg)
            for tma_o in tma_os:
                plain = two_phase.compile_state_pass(torch.bfloat16, False, False, False, raw_qk=True, fold=fold,
                                                     tma_o=tma_o).fn
                o = torch.empty_like(x["v"])
                t = graph_us(lambda: plain(*terms, o, dummy, dummy, *launch, *flags))
                fn = two_phase.compile_state_pass(torch.bfloat16, False, False, False, rs=True, profile=True,
                                                  raw_qk=True, fold=fold, tma_o=tma_o).fn
                t_prof, per_chunk_us, cyc = chain_profile(lambda *a: fn(*a, *flags), terms, x["v"], launch)
                print(f"gdn state pass B={B} H={H} T={T} {'fold' if fold else 'w, u'}"
                      f"{' tma_o' if tma_o else ''}: {t:.1f} us "
                      f"({t * schedule.grid[0] / schedule.num_tiles / -(-T // 64):.2f} us/chunk/CTA) | profile "
                      f"{per_chunk_us:.2f} us/chunk, cycles per chunk: wait+eg {cyc[0]:.0f}, products 1 {cyc[1]:.0f}, "
                      f"v_new {cyc[2]:.0f}, issue 2+o {cyc[3]:.0f}, update wait {cyc[4]:.0f}", flush=True)


MODES = {"kda-stages": time_kda_stages, "kda-fold": time_kda_fold, "one-pass": time_one_pass, "lookback": time_lookback, "pair-auto": time_pair_auto, "fold-chain": time_fold_chain, "fold": time_fold, "balance": time_balance, "solve-mma": time_solve_mma, "trio": time_trio, "raw": time_raw, "overlap": time_overlap, "phases": time_phases, "merge": time_merge, "pdl": time_pdl, "pair": time_pair, "paths": time_paths, "prep-profile": time_prep_profile,
         "prep": time_prep, "state": time_state, "chain": time_chain}


def main():
    if len(sys.argv) == 2 and sys.argv[1] in MODES:
        return MODES[sys.argv[1]]()
    for op in ("gdn", "kda"):
        kda = op == "kda"
        _, peer = ops.load_peer(op)
        ours, _ = ops.load_ours(op)
        for B, H, T in CELLS:
            x = ops.make_inputs(op, B, H, T, torch.bfloat16, "cuda")
            args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
            prep = two_phase.chunk_prep(*args, kda=kda)
            t1 = graph_us(lambda: two_phase.chunk_prep(*args, kda=kda))
            t2 = graph_us(lambda: two_phase.state_pass(prep, None, True))
            tf = graph_us(lambda: peer(x))
            la.TWO_PHASE = "0"      # the fused path (its own auto segment count)
            to = graph_us(lambda: ops.call_ours(op, ours, x))
            la.TWO_PHASE = "1"     # the whole op through the two phases, its own planned segment count
            try:
                ops.call_ours(op, ours, x)
                planned = dict(la._two_phase_plans)
                t2p = graph_us(lambda: ops.call_ours(op, ours, x))
            finally:
                la.TWO_PHASE = "auto"
            n_plan = [c.num_segments for key, c in planned.items() if key[2:5] == (B, T, H) and key[6] == kda]
            chunks = -(-T // 64)
            seg = {n: graph_us(lambda n=n: two_phase.state_pass(prep, None, True, num_segments=n))
                   for n in (4, 16) if chunks >= 2 * n}
            print(f"{op} B={B} H={H} T={T}: prep {t1:.1f} us + state pass {t2:.1f} us ({t2 / chunks:.2f} us/chunk) "
                  f"| FLA {tf:.1f} us | ours fused {to:.1f} us | FLA/two-phase {tf / (t1 + t2):.2f}x, "
                  f"FLA/fused {tf / to:.2f}x | segmented state pass "
                  + ", ".join(f"N={n}: {t:.1f} us" for n, t in seg.items())
                  + f" | op two-phase (planned N={n_plan}) {t2p:.1f} us, FLA/op {tf / t2p:.2f}x", flush=True)


if __name__ == "__main__":
    main()
