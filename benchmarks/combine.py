"""Join the JSON files of a sweep run in parts (`--cells START:END`) into one result: JSON, heatmaps, tables
(the decode-attention sweep's parts too: its own rows and plots).

    python -m benchmarks.combine OUT.json PART1.json PART2.json ...
    python -m benchmarks.combine --merge-peers OUT.json MAIN.json OTHER.json ...

Parts must be of the same op, grid, device and timing setup; a cell measured twice keeps its last measurement.
`--merge-peers` adds the peers timed in another process on the same machine (`--no-ours --peers flashqla`: a
peer whose packages cannot share ours' process) to MAIN's cells, and picks each cell's best peer again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import grids, report


def _label(value):
    """A part's setting without its parenthesized note: "f (AUTO_SEGMENTS: ...)" and "f" name the same function
    (the note was dropped from the label when the cost model became the default)."""
    return value.split(" (")[0] if isinstance(value, str) else value


def combine(parts: list[dict]) -> tuple[dict, list[dict]]:
    if not parts:
        raise ValueError("no parts given")
    keys = ("op", "grid", "device", "timer", "graph", "peer", "ours")
    meta = {k: v for k, v in parts[0].items() if k != "rows"}
    for p in parts[1:]:
        for k in keys:
            if _label(p.get(k)) != _label(meta.get(k)):
                raise ValueError(f"parts differ in {k!r}: {meta.get(k)!r} vs {p.get(k)!r}")
    meta["ours"] = parts[-1].get("ours")
    cells = {}
    for p in parts:
        for row in p["rows"]:
            cells[(row["B"], row["H"], row["T"])] = row
    meta["complete"] = all(p.get("complete", False) for p in parts)
    meta["parts"] = len(parts)
    return meta, [cells[c] for c in sorted(cells, key=_grid_order(meta.get("grid")))]


def merge_peers(main: dict, others: list[dict]) -> tuple[dict, list[dict]]:
    """MAIN's meta and rows with the per-peer times of `others` (same op, grid, device, timing) added per cell."""
    meta = {k: v for k, v in main.items() if k != "rows"}
    for o in others:
        for k in ("op", "grid", "device", "timer", "graph"):
            if o.get(k) != meta.get(k):
                raise ValueError(f"{k!r} differs: {meta.get(k)!r} vs {o.get(k)!r}")
    labels = dict(meta.get("peers") or {})
    missing = dict(meta.get("peers_missing") or {})
    by_cell = {}
    for o in others:
        labels.update(o.get("peers") or {})
        for name in o.get("peers") or {}:
            missing.pop(name, None)
        for r in o["rows"]:
            by_cell.setdefault((r["B"], r["H"], r["T"]), []).append(r)
    rows = []
    for r in main["rows"]:
        r = dict(r)
        for other in by_cell.get((r["B"], r["H"], r["T"]), []):
            for field in ("peers_gpu", "peers_eager", "peers_graph", "peer_failures"):
                r[field] = {**(r.get(field) or {}), **(other.get(field) or {})}
        rows.append(report.summarize_peers(r, labels))
    meta.update(peers=labels, peers_missing=missing, peer=", ".join(labels.values()))
    return meta, rows


def _grid_order(name):
    """A sort key that puts cells in their grid's table order (rows as the grid lists them, T ascending), whatever
    order the parts came in; cells outside the grid go last."""
    try:
        rows = grids.get_grid(name)
    except (ValueError, TypeError):
        rows = []
    rank = {(r.B, r.H): i for i, r in enumerate(rows)}
    return lambda c: (rank.get(c[:2], len(rank)), c)


def _join_decode(parts: list[dict], out: Path) -> int:
    """The decode-attention sweep's parts: its own rows, table and plots (`benchmarks.decode`)."""
    import json

    from benchmarks import decode

    meta, rows = decode.join_parts(parts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str) + "\n")
    text = decode.format_table(rows)
    print(text)
    out.with_suffix(".txt").write_text(text + "\n")
    paths = decode.write_plots(rows, out.with_suffix(""), f"decode {meta['device']} {meta.get('date', '')}")
    print("\n".join(f"wrote {p}" for p in [out, *paths]))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.combine")
    ap.add_argument("out", help="the combined JSON path (PNG heatmaps are written beside it)")
    ap.add_argument("parts", nargs="+")
    ap.add_argument("--merge-peers", action="store_true",
                    help="the first part is the main run; the others add their peers to its cells")
    args = ap.parse_args(argv)
    parts = [report.read_json(p) for p in args.parts]
    if parts[0].get("op") == "decode" and not args.merge_peers:
        return _join_decode(parts, Path(args.out))
    meta, rows = merge_peers(parts[0], parts[1:]) if args.merge_peers else combine(parts)
    out = Path(args.out)
    report.write_json(out, meta, rows)
    title = f"{meta['op']} {meta['grid']} {meta['device']} {meta.get('date', '')}  ({meta.get('peer', '')})"
    report.write_heatmap(rows, out.with_suffix(".png"), title=title)
    if report.has_graph(rows):
        report.write_heatmap(rows, out.with_name(out.stem + "_graph.png"), title=title + "  CUDA graph", graph=True)
    try:
        starts = grids.group_starts(grids.get_grid(meta["grid"]))
    except Exception:
        starts = ()
    text = report.format_report(rows, op=meta["op"], grid=meta["grid"], device=meta["device"],
                                sm_count=meta.get("sm_count"), group_starts=starts)
    print(text)
    out.with_suffix(".txt").write_text(text + "\n")
    print(f"\nwrote {out} (and .png, .txt beside it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
