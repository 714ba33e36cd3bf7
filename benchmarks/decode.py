"""Decode-attention sweep: ours against every peer that imports, in the same run, on one CUDA GPU.

    python -m benchmarks.sweep --op decode [--grid full|quick] [--cells START:END] [--scheduler split-kv|stream-k]
        [--peers sdpa,fa4,flashinfer] [--out benchmarks/results]

Cells: B x KV length x (Hq, Hkv), D = 128, bf16, contiguous cache (the full grid), plus paged caches (page size
16 and 64, pages in shuffled order) and ragged lengths (uniform in [1, L], the first row at L) on a subset.
Per cell and implementation: GPU time per call under CUDA-graph replay (the number compared), the eager host
time per call beside it, and the output's error against ours. A cache smaller than twice the L2 is timed over
several input sets in turn (same lengths, fresh q, K, V), so no call reads the cache the call before left in L2.
The copy bandwidth is measured once in the same run (a 1 GiB device-to-device copy); the floor of a cell is its
K + V bytes at that bandwidth.

Peers: torch SDPA (contiguous caches; ragged rows through a key mask), FlashAttention-4's
`flash_attn_varlen_func` (seqused_k, page_table; no split-KV on SM90), FlashInfer's
`BatchDecodeWithPagedKVCacheWrapper` (a contiguous cache is viewed as 16-token pages, no copy; `plan` runs
before the timing, `run` is timed). A peer that does not import or fails on a cell is recorded with its reason.
Writes `decode_<device>_<date>.json`, a heatmap of the speed-up over the best peer and a bandwidth-vs-length plot.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.ops import max_rel_err

D = 128
BATCHES = (1, 2, 4, 8, 16, 32, 64)
KV_LENS = (512, 1024, 4096, 16384, 32768, 131072)
HEADS = ((32, 8), (32, 4), (64, 8), (32, 32))
PEERS = ("sdpa", "fa4", "flashinfer")
COPY_BYTES = 1 << 30
MEMORY_SHARE = 0.4   # skip a cell whose cache needs more than this share of the GPU's memory


@dataclass(frozen=True)
class DecodeCell:
    B: int
    Hq: int
    Hkv: int
    kv_len: int              # the longest row's length (every row's, unless ragged)
    page_size: int = 0       # 0: contiguous [B, kv_len, Hkv, D]
    ragged: bool = False

    @property
    def label(self) -> str:
        kind = f"paged{self.page_size}" if self.page_size else "contiguous"
        return f"B={self.B} Hq={self.Hq} Hkv={self.Hkv} L={self.kv_len} {kind}" + (" ragged" if self.ragged else "")

    def cache_bytes(self) -> int:
        return 2 * self.B * self.kv_len * self.Hkv * D * 2


def grid(name: str) -> list[DecodeCell]:
    if name == "quick":
        return [DecodeCell(1, 32, 8, 4096), DecodeCell(4, 32, 8, 32768), DecodeCell(4, 32, 8, 32768, page_size=16),
                DecodeCell(16, 32, 8, 4096, ragged=True)]
    if name != "full":
        raise ValueError(f"unknown decode grid {name!r}; choose full or quick")
    cells = [DecodeCell(B, Hq, Hkv, L) for Hq, Hkv in HEADS for B in BATCHES for L in KV_LENS]
    cells += [DecodeCell(B, 32, 8, L, page_size=ps) for ps in (16, 64) for B in (1, 4, 16) for L in (4096, 32768)]
    cells += [DecodeCell(B, 32, 8, L, ragged=True) for B in (4, 16, 64) for L in (4096, 32768)]
    return cells


def make_inputs(cell: DecodeCell, device, seed: int = 0) -> dict:
    """q [B, Hq, D], the cache (contiguous, or pages in shuffled order with a page table), lengths [B] int32."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    B, L = cell.B, cell.kv_len
    if cell.ragged:
        lens = torch.randint(1, L + 1, (B,), generator=gen, dtype=torch.int32)
        lens[0] = L
    else:
        lens = torch.full((B,), L, dtype=torch.int32)
    x = {"q": torch.randn(B, cell.Hq, D, device=device, dtype=torch.bfloat16), "lens": lens.to(device),
         "table": None}
    if cell.page_size:
        pages = math.ceil(L / cell.page_size)
        order = torch.randperm(B * pages, generator=gen).to(torch.int32)
        x["table"] = order.view(B, pages).to(device)
        shape = (B * pages, cell.page_size, cell.Hkv, D)
    else:
        shape = (B, L, cell.Hkv, D)
    x["k"] = torch.randn(shape, device=device, dtype=torch.bfloat16)
    x["v"] = torch.randn(shape, device=device, dtype=torch.bfloat16)
    return x


def kv_bytes(x: dict, cell: DecodeCell) -> int:
    """K + V bytes a call must read: the rows' true lengths."""
    return int(x["lens"].sum().item()) * cell.Hkv * D * 2 * 2


def flashinfer_pages(table: torch.Tensor, lens: torch.Tensor, page_size: int):
    """(indptr [B+1], indices, last_page_len [B]) of FlashInfer's paged layout from a page table and lengths (a
    row of length 0 keeps no page and last_page_len 0)."""
    used = (lens + page_size - 1) // page_size
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = torch.cumsum(used, 0)
    keep = torch.arange(table.shape[1], device=table.device)[None, :] < used[:, None]
    indices = table[keep].to(torch.int32)
    last = torch.where(lens > 0, lens - (used - 1) * page_size, torch.zeros_like(lens)).to(torch.int32)
    return indptr, indices, last


def contiguous_as_pages(x: dict, page_size: int = 16):
    """A contiguous [B, T, Hkv, D] cache viewed as [B * T / page_size, page_size, Hkv, D] pages (no copy) and the
    page table that reads it in order."""
    B, T = x["k"].shape[:2]
    per_row = T // page_size
    table = torch.arange(B * per_row, device=x["k"].device, dtype=torch.int32).view(B, per_row)
    view = lambda t: t.view(B * per_row, page_size, *t.shape[2:])
    return view(x["k"]), view(x["v"]), table


# --------------------------------------------------------------------------- the implementations


def ours(scheduler: str):
    import cute_kernels as ck
    from schedulers.splitkv import SplitKVScheduler, StreamKScheduler

    sched = StreamKScheduler() if scheduler == "stream-k" else SplitKVScheduler()

    def call(x, cell):
        return ck.decode_attention(x["q"], x["k"], x["v"], x["lens"], page_table=x["table"], scheduler=sched,
                                   max_seqlen=cell.kv_len)

    return call


def peer_sdpa():
    import torch.nn.functional as F

    def prepare(x, cell):
        if cell.page_size:
            raise NotImplementedError("SDPA needs a contiguous cache")
        q, k, v = x["q"][:, :, None], x["k"].transpose(1, 2), x["v"].transpose(1, 2)
        mask = None
        if cell.ragged:
            mask = (torch.arange(cell.kv_len, device=q.device)[None, :] < x["lens"][:, None])[:, None, None, :]
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]

    return prepare


def peer_fa4():
    from flash_attn.cute import flash_attn_varlen_func

    def prepare(x, cell):
        q = x["q"][:, None]
        return lambda: flash_attn_varlen_func(q, x["k"], x["v"], seqused_k=x["lens"], page_table=x["table"],
                                              max_seqlen_k=cell.kv_len, causal=False, num_splits=1)[0][:, 0]

    return prepare


def peer_flashinfer():
    import flashinfer

    # one workspace for every wrapper: a cell's input sets share lengths and pages, so their plans are the same
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def prepare(x, cell):
        if cell.page_size:
            k, v, table, ps = x["k"], x["v"], x["table"], cell.page_size
        else:
            k, v, table = contiguous_as_pages(x)
            ps = 16
        indptr, indices, last = flashinfer_pages(table, x["lens"], ps)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(indptr, indices, last, cell.Hq, cell.Hkv, D, ps, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16)
        return lambda: wrapper.run(x["q"], (k, v))

    return prepare


PEER_LOADERS = {"sdpa": peer_sdpa, "fa4": peer_fa4, "flashinfer": peer_flashinfer}


# --------------------------------------------------------------------------- one cell


def time_both(timer, fn) -> tuple[float, float, str | None]:
    """(CUDA-graph us, eager us, graph error): the graph time falls back to the plain GPU time if capture fails."""
    gpu = timer.gpu_us(fn)
    eager, _ = timer.eager_us(fn, gpu)
    try:
        return timer.graph_us(fn, gpu), eager, None
    except Exception as e:
        torch.cuda.synchronize()
        return gpu, eager, f"{type(e).__name__}: {e}"[:300]


def run_cell(cell: DecodeCell, ours_call, peers: dict, timer, copy_tbps: float, l2_bytes: float) -> dict:
    from benchmarks.sweep import input_set_count, rotating

    # Input sets share the lengths and page table (fixed seed) and differ in q, K, V; the timed calls rotate
    # through them, so a cache that fits in L2 is not read from L2.
    n_sets = input_set_count(cell.cache_bytes(), l2_bytes)
    xs = [make_inputs(cell, "cuda") for _ in range(n_sets)]
    x = xs[0]
    nbytes = kv_bytes(x, cell)
    row = {**asdict(cell), "D": D, "paged": cell.page_size, "ours_us": None, "ours_eager_us": None, "peers": {},
           "peers_eager": {}, "peer_errors": {}, "rel_err": {}, "best_peer": None, "speedup_vs_best": None,
           "kv_bytes": nbytes, "tbps": None, "copy_tbps": copy_tbps, "floor_us": nbytes / (copy_tbps * 1e6),
           "of_copy_bw": None, "input_sets": n_sets, "notes": {}}
    ref = None
    try:
        ref = ours_call(x, cell)
        torch.cuda.synchronize()
        us, eager, err = time_both(timer, rotating(lambda xi: ours_call(xi, cell), xs))
        tbps = nbytes / (us * 1e6)
        row.update(ours_us=us, ours_eager_us=eager, tbps=tbps, of_copy_bw=tbps / copy_tbps)
        if err:
            row["notes"]["ours_graph_error"] = err
    except Exception as e:
        row["notes"]["ours_error"] = f"{type(e).__name__}: {e}"[:300]
    time_peers(row, peers, xs, cell, ref, timer)
    return row


def time_peers(row: dict, peers: dict, xs: list, cell, ref, timer) -> None:
    """Each peer's output error against ours (`ref`, from xs[0]; a peer's output is compared in ref's shape) and
    its graph / eager times, rotating through the input sets `xs`, into `row` (a failure as its reason), then the
    best peer and the speed-up over it."""
    from benchmarks.sweep import rotating

    for name, prepare in peers.items():
        try:
            calls = [prepare(x, cell) for x in xs]
            out = calls[0]()
            torch.cuda.synchronize()
            if ref is not None:
                row["rel_err"][name] = max_rel_err(out.reshape(ref.shape) if out.numel() == ref.numel() else out,
                                                   ref)
            del out
            us, eager, err = time_both(timer, rotating(lambda call: call(), calls))
            row["peers"][name], row["peers_eager"][name] = us, eager
            if err:
                row["notes"][f"{name}_graph_error"] = err
        except Exception as e:
            row["peer_errors"][name] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.synchronize()
    if row["peers"]:
        best = min(row["peers"], key=row["peers"].get)
        row["best_peer"] = best
        if row["ours_us"]:
            row["speedup_vs_best"] = row["peers"][best] / row["ours_us"]


def load_peers(names: str, loaders: dict, *args) -> tuple[dict, dict]:
    """(name -> prepare, name -> why missing) of the comma-separated `names`; an unknown name exits."""
    peers, missing = {}, {}
    for name in [p for p in names.split(",") if p]:
        if name not in loaders:
            raise SystemExit(f"--peers: unknown peer {name!r}; choose from {', '.join(loaders)}")
        try:
            peers[name] = loaders[name](*args)
        except Exception as e:
            missing[name] = f"{type(e).__name__}: {e}"[:300]
            print(f"peer {name} not available: {missing[name]}", file=sys.stderr)
    return peers, missing


def sweep_cells(cells: list, run, desc: str, stem: Path, meta: dict) -> list[dict]:
    """`run(cell)` for every cell under a progress bar, the JSON at `stem` rewritten after each (a stopped sweep
    keeps its cells), failures and disagreeing peers reported as they come."""
    import json

    from tqdm import tqdm

    rows = []
    with torch.inference_mode():
        bar = tqdm(cells, desc=desc, unit="cell")
        for cell in bar:
            bar.set_postfix_str(cell.label)
            row = run(cell)
            if row["notes"].get("ours_error"):
                bar.write(f"ours failed at {cell.label}: {row['notes']['ours_error']}")
            bad = {n: e for n, e in row["rel_err"].items() if e > 2e-2}
            if bad:
                bar.write(f"{cell.label}: outputs differ from ours: {bad}")
            rows.append(row)
            torch.cuda.empty_cache()
            stem.with_suffix(".json").write_text(json.dumps({**meta, "complete": False, "rows": rows}, indent=1,
                                                            default=str))
    stem.with_suffix(".json").write_text(json.dumps({**meta, "complete": True, "rows": rows}, indent=1, default=str))
    return rows


def join_parts(parts: list[dict]) -> tuple[dict, list[dict]]:
    """One decode table from the JSON of a sweep run in parts (`--cells`): the parts must share device, grid,
    timer and scheduler; a cell measured twice keeps its last row; rows in grid order."""
    if not parts:
        raise ValueError("no parts given")
    meta = {k: v for k, v in parts[0].items() if k != "rows"}
    for p in parts[1:]:
        for k in ("op", "device", "grid", "timer", "scheduler"):
            if p.get(k) != meta.get(k):
                raise ValueError(f"parts differ in {k!r}: {meta.get(k)!r} vs {p.get(k)!r}")
    fields = ("B", "Hq", "Hkv", "kv_len", "page_size", "ragged")
    order = {tuple(asdict(c)[f] for f in fields): i for i, c in enumerate(grid(meta["grid"]))}
    rows = {}
    for p in parts:
        for r in p["rows"]:
            rows[tuple(r[f] for f in fields)] = r
    meta["complete"] = all(p.get("complete", False) for p in parts)
    meta["parts"] = len(parts)
    meta["copy_tbps_parts"] = [p.get("copy_tbps") for p in parts]   # each part measured its own (rows keep theirs)
    meta["peers_missing"] = {k: v for p in parts for k, v in (p.get("peers_missing") or {}).items()}
    return meta, [rows[k] for k in sorted(rows, key=lambda k: order.get(k, len(order)))]


def copy_bandwidth(timer) -> float:
    """TB/s of a 1 GiB device-to-device copy (read + write bytes)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = timer.gpu_us(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / (us * 1e6)


# --------------------------------------------------------------------------- report


def format_table(rows: list[dict]) -> str:
    names = sorted({n for r in rows for n in list(r["peers"]) + list(r["peer_errors"])})
    head = f"{'cell':46s} {'ours us':>9s} {'TB/s':>6s} {'of copy':>7s} " + " ".join(f"{n:>11s}" for n in names) + \
        f" {'best':>11s} {'x best':>7s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cell = DecodeCell(r["B"], r["Hq"], r["Hkv"], r["kv_len"], r["page_size"], r["ragged"])
        peers = " ".join(f"{r['peers'][n]:11.1f}" if n in r["peers"] else f"{'-':>11s}" for n in names)
        ours_us = f"{r['ours_us']:9.1f}" if r["ours_us"] else f"{'FAIL':>9s}"
        tb = f"{r['tbps']:6.2f}" if r["tbps"] else f"{'-':>6s}"
        frac = f"{r['of_copy_bw']:7.0%}" if r["of_copy_bw"] else f"{'-':>7s}"
        sp = r["speedup_vs_best"]
        mark = "" if sp is None or sp >= 1.0 else " !"
        lines.append(f"{cell.label:46s} {ours_us} {tb} {frac} {peers} {r['best_peer'] or '-':>11s} "
                     f"{(f'{sp:7.2f}' if sp else '      -')}{mark}")
    return "\n".join(lines)


def write_plots(rows: list[dict], stem: Path, title: str) -> list[Path]:
    """Heatmap of the speed-up over the best peer (contiguous, full-length cells: rows (Hq, Hkv, B), columns
    the KV length) and TB/s against the KV length for (Hq, Hkv) = (32, 8), one line per B, the copy bandwidth
    dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import Normalize

    plain = [r for r in rows if not r["page_size"] and not r["ragged"]]
    keys = sorted({(r["Hq"], r["Hkv"], r["B"]) for r in plain})
    lens = sorted({r["kv_len"] for r in plain})
    by = {(r["Hq"], r["Hkv"], r["B"], r["kv_len"]): r for r in plain}
    data = np.full((len(keys), len(lens)), np.nan)
    for i, k in enumerate(keys):
        for j, L in enumerate(lens):
            r = by.get((*k, L))
            if r is not None and r["speedup_vs_best"]:
                data[i, j] = r["speedup_vs_best"]
    out = []
    fig, ax = plt.subplots(figsize=(2.6 + 0.9 * max(len(lens), 1), 1.6 + 0.3 * max(len(keys), 1)))
    finite = data[np.isfinite(data)]
    span = max(float(np.abs(np.log2(finite)).max()) if finite.size else 0.0, math.log2(1.25))
    im = ax.imshow(np.ma.masked_invalid(np.log2(data)), cmap=plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey"),
                   norm=Normalize(-span, span), aspect="auto")
    fig.colorbar(im, ax=ax, label="log2 speed-up over the best peer (CUDA graph)")
    for i in range(len(keys)):
        for j in range(len(lens)):
            ax.text(j, i, f"{data[i, j]:.2f}" if np.isfinite(data[i, j]) else "·", ha="center", va="center",
                    fontsize=7)
    ax.set_xticks(range(len(lens)), [str(L) for L in lens])
    ax.set_yticks(range(len(keys)), [f"{hq}/{hkv} B={b}" for hq, hkv, b in keys])
    ax.set_xlabel("KV length")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = stem.parent / (stem.name + "_speedup.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    out.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b in sorted({r["B"] for r in plain}):
        pts = sorted((r["kv_len"], r["tbps"]) for r in plain if r["B"] == b and (r["Hq"], r["Hkv"]) == (32, 8)
                     and r["tbps"])
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"ours B={b}")
    copy = [r["copy_tbps"] for r in rows if r.get("copy_tbps")]
    if copy:
        ax.axhline(copy[0], ls="--", color="grey", label=f"copy {copy[0]:.2f} TB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV length (tokens)")
    ax.set_ylabel("K + V bytes / GPU time (TB/s)")
    ax.set_title(f"{title}: Hq 32, Hkv 8", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = stem.parent / (stem.name + "_bandwidth.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    out.append(path)
    return out


# --------------------------------------------------------------------------- main


def add_sweep_args(p: argparse.ArgumentParser, peers: tuple) -> argparse.ArgumentParser:
    """The arguments both decode sweeps take: grid, cells, peers, output folder, timing budgets."""
    p.add_argument("--grid", default="full", choices=["full", "quick"])
    p.add_argument("--cells", default=None, metavar="START:END[,I,...]", help="only these cells of the grid")
    p.add_argument("--peers", default=",".join(peers), help="comma-separated peers (default: all that import)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--rep-ms", type=float, default=50.0)
    p.add_argument("--warmup-ms", type=float, default=10.0)
    p.add_argument("--reps", type=int, default=50)
    return p


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep --op decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=["decode"], default="decode")
    p.add_argument("--scheduler", default="split-kv", choices=["split-kv", "stream-k"])
    return add_sweep_args(p, PEERS).parse_args(argv)


def main(argv=None) -> int:
    from benchmarks import report
    from benchmarks.sweep import NO_GPU_MSG, Timer, l2_size, select_cells

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print(NO_GPU_MSG, file=sys.stderr)
        return 2
    peers, missing = load_peers(args.peers, PEER_LOADERS)
    timer = Timer(args.reps, args.warmup_ms, args.rep_ms)
    props = torch.cuda.get_device_properties(0)
    # --cells indexes the whole grid, so an index names the same cell on every card; then the cells over memory drop
    named = select_cells(grid(args.grid), args.cells) if args.cells else grid(args.grid)
    cells = [c for c in named if c.cache_bytes() <= MEMORY_SHARE * props.total_memory]
    skipped = len(named) - len(cells)
    copy_tbps = copy_bandwidth(timer)
    torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(0)
    date = datetime.date.today().isoformat()
    print(f"{device}: copy bandwidth {copy_tbps:.2f} TB/s; {len(cells)} cells ({skipped} over "
          f"{MEMORY_SHARE:.0%} of the memory skipped); peers {', '.join(peers) or 'none'}")
    tag = "" if not args.cells else "_cells" + args.cells.replace(":", "-").replace(",", "_")
    stem = Path(args.out) / f"decode_{report.device_short_name(device)}_{date}{tag}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": device, "date": date, "torch": torch.__version__, "op": "decode", "grid": args.grid,
            "scheduler": args.scheduler, "copy_tbps": copy_tbps, "l2_bytes": l2_size(), "peers_missing": missing,
            "timer": timer.name,
            "time": "GPU time per call under CUDA-graph replay (eager host time per call beside it)"}
    call = ours(args.scheduler)
    l2_bytes = l2_size()
    rows = sweep_cells(cells, lambda cell: run_cell(cell, call, peers, timer, copy_tbps, l2_bytes), "decode", stem,
                       meta)
    print(format_table(rows))
    paths = write_plots(rows, stem, f"decode {report.device_short_name(device)} {date}")
    print("\n".join(f"wrote {p}" for p in [stem.with_suffix(".json"), *paths]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
