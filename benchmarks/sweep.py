"""Benchmark sweep: our op vs its peers over a grid of (B, H, T) cells, on one CUDA GPU.

    python -m benchmarks.sweep --op {kda,gdn} --grid {seed,small,large} [--peers fla,flashinfer,flashqla]
        [--graph] [--out benchmarks/results] [--dtype bf16] [--reps N] [--no-ours] [--limit-cells N]
        [--bw-tbs 4.2] [--tflops 729] [--fla-safe-gate]

Per cell: fresh random inputs on the GPU; GPU time (median) of ours and of each peer (`benchmarks.peers`: inputs
converted to the peer's convention outside the timing), with eager and CUDA-graph times beside it, each peer's
output error against ours, the best peer and the speed-up over it, measured in the
same run with ``triton.testing.do_bench`` (or CUDA events when triton is missing); eager wall time
per call (host clock around N back-to-back calls, one synchronize at the end); a loose correctness
check of ours vs the peer; the roofline floor.  When one input set is smaller than twice the L2
cache, the timed callables rotate among several input sets so that the cache does not flatter.

``--op decode`` runs the decode-attention sweep instead (``benchmarks/decode.py``), ``--op gdn_decode`` /
``kda_decode`` the decode-step sweep (``benchmarks/recurrent_decode.py``): their own grids and peers.

Without a CUDA GPU it prints a message and exits with status 2; it never invents numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import math
import statistics
import sys
import time

import torch

from benchmarks import grids, ops, report, roofline
from benchmarks.peers import PEERS, load_peers

NO_GPU_MSG = "no CUDA GPU found: the benchmark needs one (nothing was measured)"
L2_BYTES = 60e6  # fallback when torch does not report the L2 size
MAX_INPUT_SETS = 32
EAGER_BUDGET_S = 0.5  # aim for about this much host time per eager measurement
GRAPH_MAX_CALLS = 200  # most calls captured in one CUDA graph (--graph)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--op", required=True, choices=ops.OPS)
    p.add_argument("--grid", required=True, choices=sorted(grids.GRIDS))
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON and PNG (default: %(default)s)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of q, k, v, beta, o")
    p.add_argument("--reps", type=int, default=100,
                   help="max calls for the eager wall time, and timed calls of the CUDA-event fallback")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up budget, ms")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench measuring budget, ms")
    p.add_argument("--no-ours", action="store_true", help="time only the peers")
    p.add_argument("--peers", default=",".join(PEERS),
                   help="comma-separated peers of %(default)s (default: all that import here; one that does not is "
                        "listed in the JSON's peers_missing with the reason)")
    p.add_argument("--scheduler", default="default", choices=["default", "segment"],
                   help="kda/gdn: ours as the planner runs it (set CUTE_KERNELS_PATH to pin a path); 'segment': the "
                        "fused kernel with SegmentScheduler() (segment count per cell by plan_segments). The plan is "
                        "kept in the JSON's extra.plan; results get a '-segment' tag")
    p.add_argument("--limit-cells", type=int, default=None, help="only the first N cells of the grid")
    p.add_argument("--cells", default=None, metavar="START:END[,I,...]",
                   help="only cells START..END-1 of the grid (or a comma-separated list of indices and ranges) (to split a long sweep across device calls; the files "
                        "get a _cellsSTART-END tag; python -m benchmarks.combine joins the parts)")
    p.add_argument("--bw-tbs", type=float, default=None,
                   help="bandwidth ceiling, TB/s (default: the card's measured copy bandwidth)")
    p.add_argument("--tflops", type=float, default=roofline.TENSOR_FLOPS_PER_S / 1e12, help="compute ceiling, TFLOP/s")
    p.add_argument("--graph", action="store_true",
                   help="also time both sides replayed from a CUDA graph (kernel time without host launch gaps)")
    p.add_argument("--fla-safe-gate", action="store_true",
                   help="kda only: call FLA with safe_gate=True, lower_bound=-5 (the inputs respect it)")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


# --------------------------------------------------------------------------- timing


def graph_replay_us(fn, calls: int = 1, replays: int = 7, warmup: int = 2) -> float:
    """Median GPU time per call of `fn`: `calls` calls captured in one CUDA graph (after `warmup` calls on a side
    stream, as capture wants), one warm replay, then the median of `replays` timed replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


class Timer:
    """GPU time (median, us) of a zero-argument callable, and its eager wall time per call."""

    def __init__(self, reps: int, warmup_ms: float, rep_ms: float):
        self.reps, self.warmup_ms, self.rep_ms = reps, warmup_ms, rep_ms
        try:
            from triton.testing import do_bench

            self._do_bench, self.name = do_bench, "triton.testing.do_bench(return_mode='median')"
        except Exception:
            self._do_bench, self.name = None, "cuda events, median"
        self._flush = None  # L2 flush buffer of the fallback (do_bench has its own)

    def gpu_us(self, fn) -> float:
        if self._do_bench is not None:
            ms = self._do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
            return float(ms) * 1e3
        if self._flush is None:
            self._flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
        for _ in range(5):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for s, e in zip(starts, ends):
            self._flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3

    def graph_us(self, fn, gpu_us: float) -> float:
        """GPU time per call when n calls are captured in one CUDA graph and replayed (no host gaps).

        n is sized from the plain GPU time so one replay takes about --rep-ms; median of 5 replays.
        """
        n = max(1, min(GRAPH_MAX_CALLS, int(self.rep_ms * 1e3 / max(gpu_us, 1.0))))
        torch.cuda.empty_cache()
        us = graph_replay_us(fn, calls=n, replays=5)
        torch.cuda.empty_cache()
        return us

    def eager_us(self, fn, gpu_us: float) -> tuple[float, int]:
        """Host time per call over n back-to-back calls (n from --reps and a time budget)."""
        n = max(1, min(self.reps, max(5, int(EAGER_BUDGET_S * 1e6 / max(gpu_us, 1e-3)))))
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6, n


def select_cells(todo: list, spec: str) -> list:
    """The cells of `todo` that `spec` names: comma-separated indices ("7") and ranges ("0:9", ":9", "140:"),
    in the order given, each cell once."""
    picked: list[int] = []
    for part in spec.split(","):
        if ":" in part:
            start, _, end = part.partition(":")
            picked += range(len(todo))[int(start or 0): int(end) if end else None]
        else:
            i = int(part)
            if not -len(todo) <= i < len(todo):
                raise SystemExit(f"--cells: index {i} is outside the grid's {len(todo)} cells")
            picked.append(i % len(todo))
    return [todo[i] for i in dict.fromkeys(picked)]


def input_set_count(set_bytes: int, l2_bytes: float) -> int:
    """How many input sets a cell rotates through: enough that one pass over them is twice the L2 (at most
    MAX_INPUT_SETS), so a timed call does not find its inputs left in L2 by the call before."""
    return 1 if set_bytes >= 2 * l2_bytes else min(MAX_INPUT_SETS, math.ceil(2 * l2_bytes / set_bytes))


def l2_size() -> float:
    """Bytes of L2 on the current GPU (L2_BYTES where torch does not say)."""
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_BYTES


def rotating(call, input_sets):
    """A zero-argument callable that runs ``call`` on the next input set each time."""
    it = itertools.cycle(input_sets)
    return lambda: call(next(it))


def _jsonable(obj):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


# --------------------------------------------------------------------------- one cell


def _graph_time(timer, fn, gpu_us, extra, who):
    """extra[f"{who}_graph_us"] = CUDA-graph time per call, or the capture error."""
    try:
        extra[f"{who}_graph_us"] = timer.graph_us(fn, gpu_us)
    except Exception as e:
        extra[f"{who}_graph_us"] = None
        extra[f"{who}_graph_error"] = f"{type(e).__name__}: {e}"
        torch.cuda.synchronize()


def run_cell(op, B, H, T, *, dtype, ours, peers, timer, ceilings, l2_bytes, graph=False) -> dict:
    """One cell: ours and every peer (`peers`: {name: benchmarks.peers.Peer}) on the same input sets; per peer its
    GPU, eager and (with `graph`) CUDA-graph time and its output's error against ours; then the best peer."""
    cost = roofline.cell_cost(op, B, H, T, io_bytes=dtype.itemsize)
    floor_us, bound = roofline.floor_us(cost, ceilings)
    row = dict(op=op, B=B, H=H, T=T, ours_us=None, ours_eager_us=None, ours_graph_us=None, peer=None, peer_us=None,
               peer_eager_us=None, speedup=None, floor_us=floor_us, floor_bound=bound, max_rel_err=None,
               peers_gpu={}, peers_eager={}, peers_graph={}, peer_errors={}, peer_failures={},
               extra={"bytes": cost.bytes, "flops": cost.flops})
    extra = row["extra"]

    first = ops.make_inputs(op, B, H, T, dtype, "cuda")
    set_bytes = ops.inputs_nbytes(first)
    n_sets = input_set_count(set_bytes, l2_bytes)
    sets = [first] + [ops.make_inputs(op, B, H, T, dtype, "cuda") for _ in range(n_sets - 1)]
    extra["input_sets"] = n_sets

    # One plain call of ours: compiles, and gives the outputs each peer is checked against.
    ours_out = None
    if ours is not None:
        try:
            ours_out = ops.call_ours(op, ours, first)
        except ops.NOT_AVAILABLE as e:
            extra["ours"] = f"not available: {type(e).__name__}: {e}"
        except Exception as e:  # a bug in ours: record it and keep the sweep going
            extra["ours_error"] = f"{type(e).__name__}: {e}"
        if ours_out is not None:
            plan = ops.last_plan()
            if plan is not None:
                extra["plan"] = _jsonable(plan)
    torch.cuda.synchronize()

    for name, peer in peers.items():
        try:
            prepared = [peer.prepare(x) for x in sets]   # the peer's conventions, outside the timing
            out = peer.outputs(peer.call(prepared[0]), prepared[0])   # compiles / autotunes
            if ours_out is not None:
                row["peer_errors"][name] = ops.max_rel_err(ours_out, out)
            del out
            fn = rotating(peer.call, prepared)
            row["peers_gpu"][name] = timer.gpu_us(fn)
            row["peers_eager"][name], _ = timer.eager_us(fn, row["peers_gpu"][name])
            if graph:
                _graph_time(timer, fn, row["peers_gpu"][name], extra, name)
                row["peers_graph"][name] = extra.pop(f"{name}_graph_us")
            del prepared, fn
        except Exception as e:   # a peer that cannot run this cell: recorded, the others go on
            row["peer_failures"][name] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.synchronize()
    if row["peer_errors"]:
        row["max_rel_err"] = max(row["peer_errors"].values())
    del ours_out

    if ours is not None and "ours" not in extra and "ours_error" not in extra:
        ours_fn = rotating(lambda x: ops.call_ours(op, ours, x), sets)
        try:
            row["ours_us"] = timer.gpu_us(ours_fn)
            row["ours_eager_us"], extra["ours_eager_calls"] = timer.eager_us(ours_fn, row["ours_us"])
            if graph:
                _graph_time(timer, ours_fn, row["ours_us"], extra, "ours")
                row["ours_graph_us"] = extra.get("ours_graph_us")
        except Exception as e:
            row["ours_us"] = row["ours_eager_us"] = None
            extra["ours_error"] = f"while timing: {type(e).__name__}: {e}"
    return report.summarize_peers(row, {n: p.label for n, p in peers.items()})


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    op = argv[argv.index("--op") + 1] if "--op" in argv[:-1] else next(
        (a.split("=", 1)[1] for a in argv if a.startswith("--op=")), None)
    if op == "decode":
        from benchmarks import decode

        return decode.main(argv)
    if op in ("gdn_decode", "kda_decode"):
        from benchmarks import recurrent_decode

        return recurrent_decode.main(argv)
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_GPU_MSG, file=sys.stderr)
        return 2

    from tqdm import tqdm

    names = [n for n in args.peers.split(",") if n]
    try:
        peers, peers_missing = load_peers(args.op, names, fla_safe_gate=args.fla_safe_gate)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, why in peers_missing.items():
        print(f"peer {name} not available: {why}", file=sys.stderr)
    if not peers:
        print(f"error: none of the peers {', '.join(names)} can run here", file=sys.stderr)
        return 1
    peer_label = ", ".join(p.label for p in peers.values())
    if args.no_ours:
        ours, ours_status = None, "skipped (--no-ours)"
    else:
        ours, why = ops.load_ours(args.op)
        ours_status = why or f"cute_kernels.{ops.OURS_ATTR[args.op]}"
        if ours is not None and args.scheduler == "segment" and args.op in ("kda", "gdn"):
            import functools

            from schedulers import SegmentScheduler

            ours = functools.partial(ours, scheduler=SegmentScheduler())
            ours_status += " (scheduler=SegmentScheduler())"
        if ours is None:
            print(f"note: {why}; timing the peer only", file=sys.stderr)

    dtype = DTYPES[args.dtype]
    rows_def = grids.get_grid(args.grid)
    todo = grids.cells(rows_def)[: args.limit_cells]
    if args.cells:
        todo = select_cells(todo, args.cells)
    props = torch.cuda.get_device_properties(0)
    device_name = torch.cuda.get_device_name(0)
    ceilings = roofline.Ceilings.from_cli(args.bw_tbs or roofline.copy_bw_tbs(device_name), args.tflops)
    l2_bytes = l2_size()
    timer = Timer(args.reps, args.warmup_ms, args.rep_ms)
    date = datetime.date.today().isoformat()
    meta = {
        "device": device_name, "date": date, "torch": torch.__version__, "op": args.op, "grid": args.grid,
        "ceilings": ceilings.as_dict(), "dtype": args.dtype, "sm_count": props.multi_processor_count,
        "l2_bytes": l2_bytes, "timer": timer.name, "graph": args.graph, "peer": peer_label, "ours": ours_status,
        "peers": {n: p.label for n, p in peers.items()}, "peers_missing": peers_missing,
    }

    torch.manual_seed(0)
    rows: list[dict] = []
    finished = False
    tag = args.grid + ("" if args.scheduler == "default" else "-" + args.scheduler)
    if names != ["fla"]:   # several peers (or another one): {op}_peers_<device>_<date> for the seed grid
        tag = "peers" + ("" if tag == "seed" else "-" + tag)
    if args.cells:
        tag += "_cells" + args.cells.replace(":", "-").replace(",", "_")
    stem = report.result_stem(args.out, args.op, tag, device_name, date)
    try:
        with torch.inference_mode():
            bar = tqdm(todo, desc=f"{args.op} {args.grid}", unit="cell")
            for B, H, T in bar:
                bar.set_postfix_str(f"B={B} H={H} T={T}")
                row = run_cell(args.op, B, H, T, dtype=dtype, ours=ours, peers=peers, timer=timer, ceilings=ceilings,
                               l2_bytes=l2_bytes, graph=args.graph)
                for name, why in row["peer_failures"].items():
                    bar.write(f"{name} failed at B={B} H={H} T={T}: {why}")
                if row["extra"].get("ours_error"):
                    bar.write(f"ours failed at B={B} H={H} T={T}: {row['extra']['ours_error']}")
                if report.rel_err_bad(row):
                    bar.write(f"ours differs from the peer at B={B} H={H} T={T}: rel err {row['max_rel_err']:.3g}")
                rows.append(row)
                # Checkpoint after every cell: a run killed from outside still leaves what it measured.
                report.write_json(stem.with_suffix(".json"), dict(meta, complete=False), rows)
                torch.cuda.empty_cache()
        finished = True
    finally:
        if rows:
            if not finished:
                print(f"\nstopped after {len(rows)} of {len(todo)} cells; writing what was measured", file=sys.stderr)
            print()
            print(report.format_report(rows, op=args.op, grid=args.grid, device=device_name,
                                       sm_count=props.multi_processor_count,
                                       group_starts=grids.group_starts(rows_def)))
            meta["complete"] = finished
            json_path = report.write_json(stem.with_suffix(".json"), meta, rows)
            png_path = report.write_heatmap(rows, stem.with_suffix(".png"),
                                            title=f"{args.op} {args.grid} {device_name} {date}  ({peer_label})")
            print(f"\nwrote {json_path}\nwrote {png_path}")
            if report.has_graph(rows):
                graph_png = report.write_heatmap(rows, stem.parent / (stem.name + "_graph.png"), graph=True,
                                                 title=f"{args.op} {args.grid} {device_name} {date}  CUDA graph  ({peer_label})")
                print(f"wrote {graph_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
