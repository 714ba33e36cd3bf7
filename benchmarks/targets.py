"""How far issue 5's speed-up targets sit from the roofline floor, cell by cell.

    python -m benchmarks.targets RESULT.json [--bw-tbs 4.2] [--tflops 729] [--out FILE]

A target "k times faster than the peer" on a cell is a time: ``peer_us / k`` (the CUDA-graph time of the peer
where the result has one, else its do_bench median). This module sets that time beside two floors of the cell:

* the **memory floor**: every input read once and every output written once at the copy bandwidth
  (:func:`benchmarks.roofline.linear_attention_cost`'s bytes). It holds for any algorithm: no kernel can be
  faster than a copy of its own inputs and outputs.
* the **floor** of the result tables: ``max(memory floor, FLOPs / tensor throughput)``, with the FLOPs of the
  chunked algorithm at C = 64 (:func:`benchmarks.roofline.chunk_flops`, 11.8 MFLOP per chunk and head). A smaller
  chunk lowers the FLOPs towards the state terms alone (3 x 2 K V per token, 6.3 MFLOP per 64 tokens), so this
  one is a floor of the algorithm, not of the problem.

``target / memory floor < 1`` means the target cannot be met by any kernel on a device with these ceilings;
close to 1 means the kernel must stream its bytes at the copy speed while also doing its matmuls, with no gap.
The tables also give ``ours / target``: how many times faster ours must get to meet the target (<= 1: met).

The targets (issue 5, "Done when"): 8x at B*H <= 32 and T >= 4096; 3x at every T >= 1024.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks import grids, report
from benchmarks.roofline import Ceilings, cell_cost


@dataclass(frozen=True)
class Target:
    """A speed-up target over the peer on the cells where ``applies(B, H, T)``."""

    name: str
    factor: float
    applies: Callable[[int, int, int], bool]
    where: str


TARGETS = (
    Target("8x", 8.0, lambda B, H, T: B * H <= 32 and T >= 4096, "B*H <= 32, T >= 4096"),
    Target("3x", 3.0, lambda B, H, T: T >= 1024, "T >= 1024"),
)


def peer_time_us(row: dict) -> float | None:
    """The peer's GPU time of the cell: its CUDA-graph replay time where measured, else its do_bench median."""
    v = report.peer_graph_us(row)
    return v if isinstance(v, (int, float)) else row.get("peer_us")


def ours_time_us(row: dict) -> float | None:
    """Our GPU time of the cell, measured the same way as :func:`peer_time_us` (graph replay where the peer has it)."""
    if isinstance(report.peer_graph_us(row), (int, float)):
        return report.ours_graph_us(row)
    return row.get("ours_us")


def floors_us(row: dict, ceilings: Ceilings) -> tuple[float, float]:
    """(memory floor, table floor) of the cell in microseconds; the table floor is max(memory, compute)."""
    cost = cell_cost(row["op"], row["B"], row["H"], row["T"])
    mem = cost.bytes / ceilings.bytes_per_s * 1e6
    comp = cost.flops / ceilings.flops_per_s * 1e6
    return mem, max(mem, comp)


def target_rows(rows: list[dict], target: Target, ceilings: Ceilings) -> list[dict]:
    """The cells the target applies to, each a row dict (B, H, T kept for the tables) with ``target_us``,
    ``mem_floor_us``, ``floor_us``, ``ours_us`` and the three ratios."""
    out = []
    for r in rows:
        B, H, T = r["B"], r["H"], r["T"]
        peer = peer_time_us(r)
        if not target.applies(B, H, T) or not peer:
            continue
        mem, floor = floors_us(r, ceilings)
        goal = peer / target.factor
        ours = ours_time_us(r)
        out.append({
            "op": r["op"], "B": B, "H": H, "T": T,
            "target_us": goal, "mem_floor_us": mem, "floor_us": floor, "ours_us": ours,
            "target_over_mem_floor": goal / mem,
            "target_over_floor": goal / floor,
            "ours_over_target": ours / goal if ours else None,
        })
    return out


def summary(trows: list[dict], target: Target) -> str:
    """One paragraph: how many cells, which are below or near the memory floor, the range of each ratio."""
    if not trows:
        return f"{target.name} ({target.where}): no cells."
    def rng(key):
        vals = [t[key] for t in trows if t[key] is not None]
        return f"{min(vals):.2f}-{max(vals):.2f}" if vals else "-"
    below = [t for t in trows if t["target_over_mem_floor"] < 1.0]
    near = [t for t in trows if 1.0 <= t["target_over_mem_floor"] < 1.25]
    met = [t for t in trows if t["ours_over_target"] is not None and t["ours_over_target"] <= 1.0]
    cells = lambda ts: ", ".join(f"B={t['B']} H={t['H']} T={t['T']}" for t in ts)  # noqa: E731
    lines = [
        f"{target.name} ({target.where}): {len(trows)} cells, met at {len(met)}.",
        f"  target / memory floor {rng('target_over_mem_floor')}; target / floor {rng('target_over_floor')}; "
        f"ours / target {rng('ours_over_target')}.",
        f"  below the memory floor (no kernel can meet it): {len(below)}" + (f" -- {cells(below)}" if below else ""),
        f"  within 1.25x of the memory floor (needs >= 80% of the copy bandwidth with the matmuls hidden): "
        f"{len(near)}" + (f" -- {cells(near)}" if near else ""),
    ]
    return "\n".join(lines)


def format_targets(meta: dict, rows: list[dict], ceilings: Ceilings) -> str:
    """The whole report: per target, a summary and the three tables."""
    try:
        starts = grids.group_starts(grids.get_grid(meta["grid"]))
    except Exception:
        starts = ()
    kw = dict(sm_count=meta.get("sm_count"), group_starts=tuple(starts))
    timer = "CUDA-graph replay" if report.has_graph(rows) else "do_bench median"
    head = (f"Issue 5's targets against the roofline floors: {meta.get('op')} {meta.get('grid')}, "
            f"{meta.get('device')} {meta.get('date', '')}, peer {meta.get('peer') or rows[0].get('peer', '')} "
            f"({timer}); ceilings {ceilings.bytes_per_s / 1e12:g} TB/s, {ceilings.flops_per_s / 1e12:g} TFLOP/s.")
    parts = [head]
    for target in TARGETS:
        trows = target_rows(rows, target, ceilings)
        parts.append(summary(trows, target))
        if not trows:
            continue
        parts.append(report.format_table(
            trows, lambda t: t["target_over_mem_floor"],
            f"{target.name}: target_us / memory_floor_us  (target = peer / {target.factor:g}; < 1: no kernel can "
            f"meet it)", mark_lose=True, **kw))
        parts.append(report.format_table(
            trows, lambda t: t["target_over_floor"],
            f"{target.name}: target_us / floor_us  (floor = max(memory, C = 64 chunked FLOPs))", mark_lose=True,
            **kw))
        parts.append(report.format_table(
            trows, lambda t: t["ours_over_target"],
            f"{target.name}: ours_us / target_us  (how many times faster ours must get; <= 1: met)", **kw))
    return "\n\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.targets", description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a sweep or combine JSON (benchmarks/results/*.json)")
    ap.add_argument("--bw-tbs", type=float, default=None, help="bandwidth ceiling in TB/s (default: the result's)")
    ap.add_argument("--tflops", type=float, default=None, help="tensor ceiling in TFLOP/s (default: the result's)")
    ap.add_argument("--out", default=None, help="also write the report to this file")
    args = ap.parse_args(argv)
    data = report.read_json(args.result)
    meta = {k: v for k, v in data.items() if k != "rows"}
    rows = data["rows"]
    if not rows:
        print(f"{args.result}: no rows", file=sys.stderr)
        return 1
    c = Ceilings(**meta["ceilings"]) if isinstance(meta.get("ceilings"), dict) else Ceilings()
    ceilings = Ceilings(bytes_per_s=args.bw_tbs * 1e12 if args.bw_tbs else c.bytes_per_s,
                        flops_per_s=args.tflops * 1e12 if args.tflops else c.flops_per_s)
    text = format_targets(meta, rows, ceilings)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
