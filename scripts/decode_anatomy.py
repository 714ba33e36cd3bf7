"""Where a small decode call's time goes: ours against torch SDPA, kernel by kernel, and whether consecutive calls
overlap when replayed from a CUDA graph (as the sweep times them).

    ncu --nvtx --profile-from-start off --cache-control all --metrics ... \\
        python3 scripts/decode_anatomy.py kernels [CELLS]      # one call of each inside cudaProfilerStart / Stop
    nsys profile --cuda-graph-trace=node -o OUT python3 scripts/decode_anatomy.py replay [CELLS]
    python3 scripts/decode_anatomy.py overlap OUT.sqlite       # (nsys export --type sqlite OUT.nsys-rep)
    python3 scripts/decode_anatomy.py profile [CELLS]          # the same report from torch's profiler (no nsys)

`kernels`: per cell and implementation, three warm calls, then one call between cudaProfilerStart / Stop inside an
NVTX range "<impl> <cell>", so Nsight Compute profiles just that call's kernels.
`replay`: per cell and implementation, a CUDA graph of CALLS calls over input sets rotated past the L2, replayed
REPLAYS times inside an NVTX range (synchronized, so the range holds the GPU work).
`overlap`: from the nsys trace, per range: each kernel's mean GPU time, and the mean gap from one kernel's end to the
next one's start (negative: they overlap), so one sees whether the next call starts before the last one ends.
`profile`: the replays of `replay`, each inside its own torch.profiler session (CUPTI records every kernel a graph
runs), then the report of `overlap`: for a machine without nsys.
CELLS: "B,Hq,Hkv,L;..." (default: five small cells where SDPA led the 12-07 H100 table).
"""

from __future__ import annotations

import sqlite3
import sys
from collections import defaultdict

CELLS = "1,32,4,4096;1,32,8,4096;1,32,8,16384;1,64,8,1024;16,32,4,512"
CALLS = 8
REPLAYS = 5


def _cells(spec: str):
    from benchmarks.decode import DecodeCell

    return [DecodeCell(*map(int, c.split(","))) for c in spec.split(";") if c]


def _impls(x, cell):
    from benchmarks import decode

    ours = decode.ours("split-kv")
    return {"ours": lambda: ours(x, cell), "sdpa": decode.peer_sdpa()(x, cell)}


def kernels(spec: str) -> None:
    import torch

    from benchmarks.decode import make_inputs

    for cell in _cells(spec):
        x = make_inputs(cell, "cuda")
        for name, fn in _impls(x, cell).items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"{name} {cell.label}")
            torch.cuda.cudart().cudaProfilerStart()
            fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            torch.cuda.nvtx.range_pop()


def _graphs(spec: str):
    """(label, graph) per cell and implementation: a CUDA graph of CALLS calls over input sets rotated past the L2,
    captured and replayed once."""
    import torch

    from benchmarks.decode import make_inputs
    from benchmarks.sweep import input_set_count, l2_size

    for cell in _cells(spec):
        sets = [make_inputs(cell, "cuda", seed=i) for i in range(input_set_count(cell.cache_bytes(), l2_size()))]
        for name in ("ours", "sdpa"):
            fns = [_impls(x, cell)[name] for x in sets]
            for fn in fns:
                fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(CALLS):
                    fns[i % len(fns)]()
            graph.replay()
            torch.cuda.synchronize()
            print(f"{name} {cell.label}: {len(sets)} input sets, {CALLS} calls a graph", flush=True)
            yield f"{name} {cell.label}", graph


def replay(spec: str) -> None:
    import torch

    for label, graph in _graphs(spec):
        torch.cuda.nvtx.range_push(label)
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def kernel_rows(events) -> list:
    """[(start ns, end ns, name)] of the GPU kernels among a torch profiler's events (FunctionEvent-like: a device
    type, a `time_range` in us, a name); memory copies and sets left out."""
    rows = []
    for e in events:
        if getattr(e.device_type, "name", str(e.device_type)) != "CUDA":
            continue
        if e.name.lower().startswith(("memcpy", "memset")):
            continue
        rows.append((round(e.time_range.start * 1e3), round(e.time_range.end * 1e3), e.name))
    return rows


def profile(spec: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity

    by_range = {}
    for label, graph in _graphs(spec):
        with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPLAYS):
                graph.replay()
            torch.cuda.synchronize()
        by_range[label] = kernel_rows(prof.events())
    print("\n".join(overlap_report(by_range)))


def overlap_report(rows_by_range: dict) -> list[str]:
    """Lines per range from its kernels [(start, end, name)]: per kernel name the count and mean GPU time, and the
    mean gap from each kernel's end to the next one's start (negative: the next started before this one ended)."""
    lines = []
    for label, ks in rows_by_range.items():
        ks = sorted(ks)
        per = defaultdict(list)
        for s, e, n in ks:
            per[n].append(e - s)
        gaps = [ks[i + 1][0] - ks[i][1] for i in range(len(ks) - 1)]
        span = (ks[-1][1] - ks[0][0]) if ks else 0
        lines.append(f"{label}: {len(ks)} kernels, span {span / 1e3:.1f} us, mean gap "
                     f"{(sum(gaps) / len(gaps) / 1e3) if gaps else 0.0:+.2f} us, min gap "
                     f"{(min(gaps) / 1e3) if gaps else 0.0:+.2f} us")
        for n, ds in per.items():
            lines.append(f"    {n[:70]:70s} x{len(ds):3d}  {sum(ds) / len(ds) / 1e3:7.2f} us")
    return lines


def overlap(path: str) -> None:
    db = sqlite3.connect(path)
    strings = dict(db.execute("SELECT id, value FROM StringIds"))
    cols = {r[1] for r in db.execute("PRAGMA table_info(NVTX_EVENTS)")}
    text = "COALESCE(text, '')" if "textId" not in cols else "COALESCE(text, textId)"
    ranges = []
    for start, end, t in db.execute(f"SELECT start, end, {text} FROM NVTX_EVENTS WHERE end IS NOT NULL"):
        label = strings.get(t, t) if isinstance(t, int) else t
        if label and (label.startswith("ours ") or label.startswith("sdpa ")):
            ranges.append((start, end, label))
    kernels_ = [(s, e, strings.get(n, str(n))) for s, e, n in
                db.execute("SELECT start, end, shortName FROM CUPTI_ACTIVITY_KIND_KERNEL")]
    by_range = {}
    for rs, re_, label in sorted(ranges):
        by_range[label] = [k for k in kernels_ if rs <= k[0] <= re_]
    print("\n".join(overlap_report(by_range)))


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("kernels", "replay", "overlap", "profile"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "overlap":
        if len(argv) < 2:
            raise SystemExit("overlap: give the nsys trace exported as sqlite")
        overlap(argv[1])
    else:
        {"kernels": kernels, "replay": replay, "profile": profile}[argv[0]](argv[1] if len(argv) > 1 else CELLS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
