"""Reports from the per-cell row dicts: text tables, JSON and a PNG heatmap.

Everything here is a pure function of the rows (plus a few labels), so it runs without a GPU.
A row dict has the keys of :data:`ROW_KEYS`; times are in microseconds and missing values are None.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable, Iterable

#: The keys of one row (one benchmark cell) in the JSON output.
ROW_KEYS = (
    "op", "B", "H", "T",
    "ours_us", "ours_eager_us",
    "peer", "peer_us", "peer_eager_us",
    "speedup", "floor_us", "floor_bound", "max_rel_err", "extra",
    # every peer of the run (benchmarks.peers): times per peer name, the best one and the speed-up over it
    "ours_graph_us", "peers", "best_peer", "speedup_vs_best", "peers_gpu", "peers_eager", "peers_graph",
    "peer_errors", "peer_failures",
)
#: Loose correctness tolerance: relative error of ours vs the peer output.
REL_ERR_TOL = 2e-2

NUM_W = 7  # width of a number in a table cell; each cell has two more chars for the marks
CELL_W = NUM_W + 2
LABEL = f"{'B':>4} {'H':>4} {'B*H':>5}"


# --------------------------------------------------------------------------- helpers


def has_ours(rows: Iterable[dict]) -> bool:
    """Whether any row has a time for our op."""
    return any(r.get("ours_us") is not None for r in rows)


def summarize_peers(row: dict, labels: dict) -> dict:
    """Fill a row's best-peer fields from its per-peer times: `peers` {name: us} (CUDA-graph time where the run
    measured it, else GPU time), `best_peer`, `speedup_vs_best` (against ours in the same timing), and the
    single-peer fields the tables and heatmaps read (`peer`, `peer_us`, `peer_eager_us`, `speedup`,
    extra `peer_graph_us`) from the best peer. `labels`: {name: label}. Returns the row."""
    graph = row.get("peers_graph") or {}
    gpu = row.get("peers_gpu") or {}
    row["peers"] = {n: (graph.get(n) or gpu.get(n)) for n in gpu if (graph.get(n) or gpu.get(n))}
    if not row["peers"]:
        row["best_peer"] = row["speedup_vs_best"] = None
        return row
    best = min(row["peers"], key=row["peers"].get)
    row["best_peer"] = best
    ours = row.get("ours_graph_us") if graph.get(best) else row.get("ours_us")
    row["speedup_vs_best"] = row["peers"][best] / ours if ours else None
    row["peer"] = labels.get(best, best)
    row["peer_us"] = gpu.get(best)
    row["peer_eager_us"] = (row.get("peers_eager") or {}).get(best)
    row["speedup"] = row["peer_us"] / row["ours_us"] if row.get("ours_us") and row["peer_us"] else None
    row.setdefault("extra", {})["peer_graph_us"] = graph.get(best)
    return row


def rel_err_bad(row: dict) -> bool:
    """Whether the row's correctness check failed (error over REL_ERR_TOL, or non-finite)."""
    err = row.get("max_rel_err")
    if err is None:
        return False
    if isinstance(err, str):  # "inf" / "nan" as stored in JSON
        return True
    return not math.isfinite(err) or err > REL_ERR_TOL


def _ratio(a, b):
    return a / b if a is not None and b else None


def speedup(row: dict):
    return row.get("speedup")


def ours_over_floor(row: dict):
    return _ratio(row.get("ours_us"), row.get("floor_us"))


def peer_us(row: dict):
    return row.get("peer_us")


def peer_over_floor(row: dict):
    return _ratio(row.get("peer_us"), row.get("floor_us"))


def _extra(row: dict, key: str):
    return (row.get("extra") or {}).get(key)


def graph_speedup(row: dict):
    """Speed-up with both sides replayed from a CUDA graph (``--graph``)."""
    return _ratio(_extra(row, "peer_graph_us"), _extra(row, "ours_graph_us"))


def peer_graph_us(row: dict):
    return _extra(row, "peer_graph_us")


def has_graph(rows: Iterable[dict]) -> bool:
    """Whether the rows carry CUDA-graph times (``--graph``)."""
    return any(_extra(r, "peer_graph_us") is not None for r in rows)


def fmt_num(v: float | None) -> str:
    """A number in at most NUM_W characters: 3.57, 412.3, 12345."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "·"
    if abs(v) < 100:
        return f"{v:.2f}"
    if abs(v) < 10000:
        return f"{v:.1f}"
    return f"{v:.0f}"


def _row_order(rows: list[dict]) -> list[tuple[int, int]]:
    seen: dict[tuple[int, int], None] = {}
    for r in rows:
        seen.setdefault((r["B"], r["H"]), None)
    return list(seen)


def _columns(rows: list[dict]) -> list[int]:
    return sorted({r["T"] for r in rows})


# --------------------------------------------------------------------------- tables


def format_table(
    rows: list[dict],
    value: Callable[[dict], float | None],
    title: str,
    *,
    sm_count: int | None = None,
    group_starts: Iterable[tuple[int, int]] = (),
    mark_lose: bool = False,
    mark_err: bool = False,
) -> str:
    """One table: rows "B H B*H", columns T, one number per cell.

    ``mark_lose`` appends ``!`` where the value is < 1 (speed-up: we lose); ``mark_err`` appends
    ``E`` where the correctness check failed; ``·`` means no data.  A line
    ``─── B*H >= {sm_count} (SM count) ───`` goes before the first row whose B*H >= sm_count, and a
    plain rule before each (B, H) in ``group_starts``.
    """
    Ts = _columns(rows)
    by_cell = {(r["B"], r["H"], r["T"]): r for r in rows}
    group_starts = set(group_starts)
    header = LABEL + " |" + "".join(f"{t:>{NUM_W}}  " for t in Ts)
    width = len(header.rstrip())
    lines = [title, header, "─" * width]
    sm_line_done = False
    for B, H in _row_order(rows):
        if sm_count is not None and not sm_line_done and B * H >= sm_count:
            lines.append(f"─── B*H >= {sm_count} (SM count) ───")
            sm_line_done = True
        elif (B, H) in group_starts:
            lines.append("─" * 3)
        cells = []
        for t in Ts:
            r = by_cell.get((B, H, t))
            v = value(r) if r is not None else None
            text = fmt_num(v)
            marks = ""
            if v is not None and mark_lose and v < 1:
                marks += "!"
            if r is not None and mark_err and rel_err_bad(r):
                marks += "E"
            cells.append(f"{text:>{NUM_W}}{marks:<2}")
        lines.append(f"{B:>4} {H:>4} {B * H:>5} |" + "".join(cells).rstrip())
    return "\n".join(lines)


def segments(row: dict):
    """Most segments per sequence that ours used in this cell, parsed from its plan (`last_plan()`), or None."""
    import re

    plan = _extra(row, "plan")
    if not isinstance(plan, str):
        return None
    m = re.search(r"segments per sequence: (?:(\d+) \(all|\[([\d, ]+)\]|(\d+)\.\.(\d+))", plan)
    if not m:
        return None
    if m.group(1):
        return float(m.group(1))
    if m.group(2):
        return float(max(int(x) for x in m.group(2).split(",")))
    return float(m.group(4))


def path(row: dict):
    """The path ours took in this cell, from its plan: 2 = two-phase (chunk prep + state pass), 1 = fused, else
    None (no plan, or a plan from before the two-phase path)."""
    plan = _extra(row, "plan")
    if not isinstance(plan, str):
        return None
    if "path: two-phase" in plan:
        return 2.0
    if "path: fused" in plan:
        return 1.0
    return None


def ours_graph_us(row: dict):
    v = _extra(row, "ours_graph_us")
    return v if isinstance(v, (int, float)) else None


def format_report(
    rows: list[dict],
    *,
    op: str,
    grid: str,
    device: str,
    sm_count: int | None = None,
    group_starts: Iterable[tuple[int, int]] = (),
) -> str:
    """The end-of-run text: speed-up table, then ours/floor and peer time (or peer-only tables)."""
    peer = next((r.get("peer") for r in rows if r.get("peer")), "peer")
    kw = dict(sm_count=sm_count, group_starts=tuple(group_starts))
    where = f"{op}, grid {grid}, {device}"
    if has_ours(rows):
        parts = [
            format_table(
                rows, speedup,
                f"speed-up = peer_us / ours_us  ({where}; peer: {peer})   '!' we lose, 'E' rel err > "
                f"{REL_ERR_TOL:g}, '·' no data",
                mark_lose=True, mark_err=True, **kw,
            ),
            format_table(rows, ours_over_floor, "ours_us / floor_us  (times the roofline floor; 1.00 = at the floor)", **kw),
            format_table(rows, peer_us, f"peer_us  ({peer}, GPU time, median)", **kw),
        ]
    else:
        parts = [
            format_table(rows, peer_us, f"peer_us  ({where}; peer: {peer}; no data for ours)", **kw),
            format_table(rows, peer_over_floor, "peer_us / floor_us  (times the roofline floor; 1.00 = at the floor)", **kw),
        ]
    if has_graph(rows):
        if has_ours(rows):
            parts.append(format_table(
                rows, graph_speedup,
                "speed-up under CUDA-graph replay = peer_graph_us / ours_graph_us  (no host launch gaps)",
                mark_lose=True, mark_err=True, **kw,
            ))
        parts.append(format_table(rows, peer_graph_us, f"peer_graph_us  ({peer}, CUDA-graph replay)", **kw))
        if has_ours(rows):
            parts.append(format_table(rows, ours_graph_us, "ours_graph_us  (CUDA-graph replay)", **kw))
    if any(segments(r) is not None for r in rows):
        parts.append(format_table(rows, segments, "segments per sequence chosen by ours (its plan)", **kw))
    if any(path(r) is not None for r in rows):
        parts.append(format_table(rows, path, "path chosen by ours: 2 = two-phase (chunk prep + state pass), "
                                  "1 = fused", **kw))
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- files


def device_short_name(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; anything else lower-cased with non-alphanumerics as '-'."""
    name = re.sub(r"^(nvidia|NVIDIA)\s+", "", name.strip())
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def result_stem(out_dir: str | Path, op: str, grid: str, device_name: str, date: str) -> Path:
    """``<out>/<op>_<grid>_<device-short-name>_<YYYY-MM-DD>`` (add .json / .png)."""
    return Path(out_dir) / f"{op}_{grid}_{device_short_name(device_name)}_{date}"


def _json_safe(v):
    """Non-finite floats become the strings 'inf' / '-inf' / 'nan' (strict JSON has none)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def write_json(path: str | Path, meta: dict, rows: list[dict]) -> Path:
    """Write ``{**meta, "rows": rows}``; meta holds device, date, torch, op, grid, ceilings."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = _json_safe({**meta, "rows": [{k: r.get(k) for k in ROW_KEYS} for r in rows]})
    path.write_text(json.dumps(doc, indent=1, allow_nan=False, default=str) + "\n")
    return path


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def write_heatmap(rows: list[dict], path: str | Path, title: str = "", *, graph: bool = False) -> Path:
    """PNG heatmap, rows (B, H), columns T.

    With data for ours: speed-up peer/ours on a log2 diverging scale centred at 1 (green = we win,
    red = we lose).  Without: peer time in microseconds on a log scale.  Grey = no data.  Each cell
    is annotated with its number (with " E" where the correctness check failed).
    ``graph=True`` plots the CUDA-graph-replay numbers (``--graph``) instead.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys, Ts = _row_order(rows), _columns(rows)
    by_cell = {(r["B"], r["H"], r["T"]): r for r in rows}
    if graph:
        value = graph_speedup if any(graph_speedup(r) is not None for r in rows) else peer_graph_us
    else:
        value = speedup if has_ours(rows) else peer_us
    ratio = value in (speedup, graph_speedup)
    data = np.full((len(keys), len(Ts)), np.nan)
    for i, (B, H) in enumerate(keys):
        for j, t in enumerate(Ts):
            r = by_cell.get((B, H, t))
            v = value(r) if r is not None else None
            if v is not None and v > 0 and math.isfinite(v):
                data[i, j] = v

    fig, ax = plt.subplots(figsize=(max(7.0, 2.6 + 0.85 * len(Ts)), 1.6 + 0.42 * max(len(keys), 1)))
    finite = data[np.isfinite(data)]
    if ratio:
        cmap = plt.get_cmap("RdYlGn")
        span = max(float(np.abs(np.log2(finite)).max()) if finite.size else 0.0, math.log2(1.25))
        shown = np.log2(data)
        norm = Normalize(vmin=-span, vmax=span)
        label = "speed-up peer/ours (log)" + (", CUDA graph" if graph else "")
    else:
        cmap = plt.get_cmap("viridis")
        shown = data
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (1.0, 10.0)
        norm = LogNorm(vmin=lo, vmax=max(hi, lo * 1.01))
        label = "peer time, us (log)" + (", CUDA graph" if graph else "")
    cmap = cmap.with_extremes(bad="lightgrey")
    im = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, norm=norm, aspect="auto")
    cbar = fig.colorbar(im, ax=ax, label=label)
    if ratio:
        nice = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 2 / 3, 0.8, 1, 1.25, 1.5, 2, 4, 8, 16)
        ticks = [math.log2(x) for x in nice if abs(math.log2(x)) <= span + 1e-9]
        cbar.set_ticks(ticks)
        cbar.set_ticklabels([f"{2.0 ** t:.3g}" for t in ticks])
    else:
        from matplotlib.ticker import LogLocator, ScalarFormatter

        cbar.locator = LogLocator(subs=(1.0, 2.0, 5.0))
        cbar.formatter = ScalarFormatter()
        cbar.update_ticks()
        cbar.minorticks_off()

    for i in range(len(keys)):
        for j in range(len(Ts)):
            v = data[i, j]
            text = fmt_num(float(v)) if np.isfinite(v) else "·"
            r = by_cell.get((keys[i][0], keys[i][1], Ts[j]))
            if r is not None and ratio and rel_err_bad(r):
                text += " E"
            dark = np.isfinite(v) and not ratio and norm(v) < 0.5  # viridis is dark at the low end
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_xticks(range(len(Ts)), [str(t) for t in Ts])
    ax.set_yticks(range(len(keys)), [f"B={B} H={H}" for B, H in keys])
    ax.set_xlabel("T")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
