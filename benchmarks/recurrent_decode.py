"""Decode-step sweep (`fused_recurrent_gated_delta_rule` / `fused_recurrent_kda`): ours against every peer that
imports, in the same run, on one CUDA GPU.

    python -m benchmarks.sweep --op {gdn_decode,kda_decode} [--grid full|quick] [--cells START:END]
        [--peers fla,flashinfer] [--out benchmarks/results]

Cells: B sequences x HV value heads (GVA 2: H = HV / 2 q/k heads) x Sq new tokens, K = V = 128, bf16, the serving
engines' form: raw gates with A_log and dt_bias (use_gate_in_kernel), beta as a logit, q/k l2-normalized in the
kernel, fp32 states. Ours runs in two forms: `pool` (the engine's: states read from and written back in place to
pool slots through the index arrays, `ours_us`) and `dense` (FLA's: a dense initial state, the final state
written to a new tensor: the same bytes without the index loads, `ours_dense_us`). Each peer is compared with
ours in the form it runs (`peer_forms`): FLA dense; FlashInfer dense at Sq = 1 (its fp32 kernel there has no
pool), pool above. Per cell and implementation: GPU time per call under CUDA-graph replay (compared), the eager
host time beside it, the output's error against ours. A state smaller than twice the L2 is timed over several
input sets in turn. state_tbps: the state's bytes (read once, written once: 2 x B x HV x K x V x 4) per GPU time,
against a device-to-device copy measured in the same run.

Peers: FLA's fused_recurrent (Triton), FlashInfer's GDN decode (`gated_delta_rule_decode_pretranspose` with an
fp32 state [B, HV, V, K] for Sq = 1, `gated_delta_rule_mtp` with an fp32 pool for Sq > 1; GDN only). A peer that
does not import or fails on a cell is recorded with its reason. Writes `{op}_<device>_<date>.json` and a heatmap
of the speed-up over the best peer.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

D = 128
GROUP = 2
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
VALUE_HEADS = (8, 32)
NEW_TOKENS = (1, 2, 4, 8)
PEERS = ("fla", "flashinfer")


@dataclass(frozen=True)
class StepCell:
    B: int
    H: int      # value heads (HV); q/k have H / GROUP
    Sq: int

    @property
    def label(self) -> str:
        return f"B={self.B} HV={self.H} Sq={self.Sq}"

    def state_bytes(self) -> int:
        return 2 * self.B * self.H * D * D * 4


def grid(name: str) -> list[StepCell]:
    if name == "quick":
        return [StepCell(1, 32, 1), StepCell(8, 32, 1), StepCell(64, 32, 1), StepCell(256, 32, 1),
                StepCell(8, 32, 4), StepCell(64, 8, 8)]
    if name != "full":
        raise ValueError(f"unknown decode-step grid {name!r}; choose full or quick")
    return [StepCell(B, H, Sq) for H in VALUE_HEADS for B in BATCHES for Sq in NEW_TOKENS]


def make_inputs(cell: StepCell, kda: bool, device, seed: int = 0) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    B, HV, Sq, H = cell.B, cell.H, cell.Sq, cell.H // GROUP
    x = {
        "q": r(B, Sq, H, D), "k": r(B, Sq, H, D), "v": r(B, Sq, HV, D),
        "a": r(*((B, Sq, HV, D) if kda else (B, Sq, HV))), "b": r(B, Sq, HV),
        "A_log": torch.log(torch.empty(HV).uniform_(1, 16, generator=gen)) - 3.0,
        "dt_bias": 0.5 * r(*((HV, D) if kda else (HV,))),
        "state": 0.1 * r(B, HV, D, D),
    }
    out = {n: t.to(device=device, dtype=torch.bfloat16 if n in ("q", "k", "v", "a", "b") else torch.float32)
           for n, t in x.items()}
    out["idx"] = torch.arange(B, dtype=torch.int32, device=device)
    return out


# --------------------------------------------------------------------------- the implementations

def ours(kda: bool, form: str = "pool"):
    """Ours in `form`: "pool" (states through pool slots, in place) or "dense" (FLA's call: a new final state)."""
    import cute_kernels as ck

    def prepare(x, cell):
        kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
                  use_beta_sigmoid_in_kernel=True)
        if form == "pool":
            kw.update(initial_state=x["state"].clone(), initial_state_indices=x["idx"], final_state_indices=x["idx"])
        else:
            kw.update(initial_state=x["state"], output_final_state=True)
        if kda:
            return lambda: ck.fused_recurrent_kda(x["q"], x["k"], x["v"], x["a"], x["b"], **kw)[0]
        return lambda: ck.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["a"], beta=x["b"], **kw)[0]

    return prepare


def peer_fla(kda: bool):
    if kda:
        from fla.ops.kda import fused_recurrent_kda as fn
    else:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fn

    def prepare(x, cell):
        kw = dict(initial_state=x["state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True)
        if kda:
            return lambda: fn(x["q"], x["k"], x["v"], x["a"], x["b"], **kw)[0]
        return lambda: fn(x["q"], x["k"], x["v"], g=x["a"], beta=x["b"], **kw)[0]

    return prepare


def flashinfer_state(state: torch.Tensor) -> torch.Tensor:
    """Ours / FLA's [.., K, V] state as FlashInfer's V-major [.., V, K] (a copy, before the timing)."""
    return state.transpose(-1, -2).contiguous()


def peer_flashinfer(kda: bool):
    if kda:
        raise NotImplementedError("FlashInfer has no SM90 KDA decode step")
    from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose, gated_delta_rule_mtp

    def prepare(x, cell):
        state = flashinfer_state(x["state"])
        common = dict(A_log=x["A_log"], a=x["a"], dt_bias=x["dt_bias"], b=x["b"], use_qk_l2norm=True)
        if cell.Sq == 1:
            return lambda: gated_delta_rule_decode_pretranspose(x["q"], x["k"], x["v"], state, **common)[0]
        return lambda: gated_delta_rule_mtp(x["q"], x["k"], x["v"], state, x["idx"], disable_state_update=False,
                                            **common)[0]

    return prepare


PEER_LOADERS = {"fla": peer_fla, "flashinfer": peer_flashinfer}
FORMS = ("pool", "dense")


def ours_forms(kda: bool) -> dict:
    """form -> ours' prepare, for every form in FORMS (what `run_cell` takes)."""
    return {form: ours(kda, form) for form in FORMS}


def peer_form(name: str, cell: StepCell) -> str:
    """The state form a peer's call runs in, so it is compared with ours in the same form."""
    return "dense" if name == "fla" or cell.Sq == 1 else "pool"


def compare_in_forms(row: dict, cell: StepCell) -> None:
    """Each peer's form, ours in that form over the peer (`speedup_vs_peer`), and the best peer with the speed-up
    over it, both by that same-form ratio (time_peers's plain ratio uses the pool form for every peer)."""
    ours_in = {"pool": row["ours_us"], "dense": row["ours_dense_us"]}
    row["peer_forms"] = {name: peer_form(name, cell) for name in row["peers"]}
    row["speedup_vs_peer"] = {name: us / ours_in[row["peer_forms"][name]]
                              for name, us in row["peers"].items() if ours_in[row["peer_forms"][name]]}
    row["best_peer"] = min(row["peers"], key=row["peers"].get) if row["peers"] else None
    row["speedup_vs_best"] = row["speedup_vs_peer"].get(row["best_peer"])


# --------------------------------------------------------------------------- one cell

def run_cell(cell: StepCell, kda: bool, ours_prepare: dict, peers: dict, timer, copy_tbps: float,
             l2_bytes: float) -> dict:
    """`ours_prepare`: form -> prepare (FORMS)."""
    from benchmarks.decode import time_both, time_peers
    from benchmarks.ops import max_rel_err
    from benchmarks.sweep import input_set_count, rotating

    # a state smaller than twice the L2 is timed over several input sets in turn (each with its own state)
    n_sets = input_set_count(cell.state_bytes() // 2, l2_bytes)
    xs = [make_inputs(cell, kda, "cuda", seed=i) for i in range(n_sets)]
    nbytes = cell.state_bytes()
    row = {**asdict(cell), "K": D, "V": D, "group": GROUP, "ours_us": None, "ours_dense_us": None,
           "ours_eager_us": None, "peers": {}, "peers_eager": {}, "peer_errors": {}, "rel_err": {},
           "best_peer": None, "speedup_vs_best": None, "state_bytes": nbytes, "state_tbps": None,
           "copy_tbps": copy_tbps, "floor_us": nbytes / (copy_tbps * 1e6), "of_copy_bw": None, "input_sets": n_sets,
           "notes": {}}
    ref = None
    for form in FORMS:
        try:
            calls = [ours_prepare[form](x, cell) for x in xs]
            out = calls[0]().clone()   # the first call: from the given state, as every peer's first call
            torch.cuda.synchronize()
            if ref is None:
                ref = out
            else:
                row["notes"]["ours_forms_rel_err"] = max_rel_err(out, ref)
            us, eager, err = time_both(timer, rotating(lambda call: call(), calls))
            if form == "dense":
                row["ours_dense_us"] = us
            else:
                tbps = nbytes / (us * 1e6)
                row.update(ours_us=us, ours_eager_us=eager, state_tbps=tbps, of_copy_bw=tbps / copy_tbps)
            if err:
                row["notes"][f"ours_{form}_graph_error"] = err
        except Exception as e:
            row["notes"][f"ours_{form}_error"] = f"{type(e).__name__}: {e}"[:300]
    if "ours_pool_error" in row["notes"]:
        row["notes"]["ours_error"] = row["notes"]["ours_pool_error"]
    time_peers(row, peers, xs, cell, ref, timer)
    compare_in_forms(row, cell)
    return row


# --------------------------------------------------------------------------- report

def format_table(rows: list[dict]) -> str:
    names = sorted({n for r in rows for n in list(r["peers"]) + list(r["peer_errors"])})
    head = f"{'cell':22s} {'ours us':>8s} {'dense':>8s} {'TB/s':>6s} {'of copy':>7s} " + \
        " ".join(f"{n:>10s}" for n in names) + f" {'best':>10s} {'x best':>7s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cell = StepCell(r["B"], r["H"], r["Sq"])
        peers = " ".join(f"{r['peers'][n]:10.1f}" if n in r["peers"] else f"{'-':>10s}" for n in names)
        us = f"{r['ours_us']:8.1f}" if r["ours_us"] else f"{'FAIL':>8s}"
        us += f" {r['ours_dense_us']:8.1f}" if r.get("ours_dense_us") else f" {'-':>8s}"
        tb = f"{r['state_tbps']:6.2f}" if r["state_tbps"] else f"{'-':>6s}"
        frac = f"{r['of_copy_bw']:7.0%}" if r["of_copy_bw"] else f"{'-':>7s}"
        sp = r["speedup_vs_best"]
        lines.append(f"{cell.label:22s} {us} {tb} {frac} {peers} {r['best_peer'] or '-':>10s} "
                     f"{(f'{sp:7.2f}' if sp else '      -')}{'' if sp is None or sp >= 1.0 else ' !'}")
    return "\n".join(lines)


def write_heatmap(rows: list[dict], path: Path, title: str) -> Path:
    """Speed-up over the best peer: rows (HV, B), columns Sq; log2 colour scale, grey where no peer ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import Normalize

    keys = sorted({(r["H"], r["B"]) for r in rows})
    cols = sorted({r["Sq"] for r in rows})
    by = {(r["H"], r["B"], r["Sq"]): r for r in rows}
    data = np.full((len(keys), len(cols)), np.nan)
    for i, key in enumerate(keys):
        for j, sq in enumerate(cols):
            r = by.get((*key, sq))
            if r is not None and r["speedup_vs_best"]:
                data[i, j] = r["speedup_vs_best"]
    fig, ax = plt.subplots(figsize=(2.6 + 0.9 * len(cols), 1.6 + 0.3 * len(keys)))
    finite = data[np.isfinite(data)]
    span = max(float(np.abs(np.log2(finite)).max()) if finite.size else 0.0, math.log2(1.25))
    im = ax.imshow(np.ma.masked_invalid(np.log2(data)), cmap=plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey"),
                   norm=Normalize(-span, span), aspect="auto")
    fig.colorbar(im, ax=ax, label="log2 speed-up over the best peer (CUDA graph; ours in its form)")
    for i in range(len(keys)):
        for j in range(len(cols)):
            ax.text(j, i, f"{data[i, j]:.2f}" if np.isfinite(data[i, j]) else "·", ha="center", va="center",
                    fontsize=7)
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(keys)), [f"HV={h} B={b}" for h, b in keys])
    ax.set_xlabel("new tokens per sequence (Sq)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep --op gdn_decode|kda_decode",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=["gdn_decode", "kda_decode"], required=True)
    from benchmarks.decode import add_sweep_args

    return add_sweep_args(p, PEERS).parse_args(argv)


def main(argv=None) -> int:
    from benchmarks import report
    from benchmarks.decode import copy_bandwidth, load_peers, sweep_cells
    from benchmarks.sweep import NO_GPU_MSG, Timer, l2_size, select_cells

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print(NO_GPU_MSG, file=sys.stderr)
        return 2
    kda = args.op == "kda_decode"
    peers, missing = load_peers(args.peers, PEER_LOADERS, kda)
    timer = Timer(args.reps, args.warmup_ms, args.rep_ms)
    cells = grid(args.grid)
    if args.cells:
        cells = select_cells(cells, args.cells)
    copy_tbps = copy_bandwidth(timer)
    torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(0)
    date = datetime.date.today().isoformat()
    print(f"{device}: copy bandwidth {copy_tbps:.2f} TB/s; {len(cells)} cells; peers {', '.join(peers) or 'none'}")
    tag = "" if not args.cells else "_cells" + args.cells.replace(":", "-").replace(",", "_")
    stem = Path(args.out) / f"{args.op}_{report.device_short_name(device)}_{date}{tag}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": device, "date": date, "torch": torch.__version__, "op": args.op, "grid": args.grid,
            "copy_tbps": copy_tbps, "l2_bytes": l2_size(), "peers_missing": missing, "timer": timer.name,
            "time": "GPU time per call under CUDA-graph replay (eager host time per call beside it)"}
    prepare = ours_forms(kda)
    l2_bytes = l2_size()
    rows = sweep_cells(cells, lambda cell: run_cell(cell, kda, prepare, peers, timer, copy_tbps, l2_bytes), args.op,
                       stem, meta)
    print(format_table(rows))
    path = write_heatmap(rows, stem.parent / (stem.name + "_speedup.png"),
                         f"{args.op} {report.device_short_name(device)} {date}")
    print("\n".join(f"wrote {p}" for p in [stem.with_suffix(".json"), path]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
