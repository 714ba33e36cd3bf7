"""CPU tests of the benchmark harness (no GPU, no FLA needed)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import grids, report, roofline
from benchmarks.sweep import NO_GPU_MSG

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- grids


def test_seed_grid_rows_and_cells():
    rows = grids.get_grid("seed")
    assert [(r.B, r.H) for r in rows] == [
        (1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (2, 16), (4, 4), (4, 8), (8, 4),
        (4, 16), (8, 8), (8, 16), (4, 32), (8, 32), (16, 32), (32, 32), (4, 64), (8, 64), (16, 64), (32, 64),
    ]
    all_t = tuple(64 * 2**i for i in range(9))
    assert all_t[-1] == 16384
    for r in rows[:12]:
        assert r.Ts == all_t
    for r in rows[12:19]:
        assert r.Ts == (64, 256, 1024, 4096, 16384)
    assert rows[-1].Ts == (64, 256, 1024, 4096)  # (32, 64) stops at 4096
    assert len(grids.cells(rows)) == 12 * 9 + 7 * 5 + 4
    # the separator sits between (8, 4) and (4, 16)
    assert grids.group_starts(rows) == {(4, 16)}


def test_small_and_large_grids():
    small = grids.get_grid("small")
    assert [(r.B, r.H) for r in small] == [(1, 4), (2, 8), (4, 16)]
    assert all(r.Ts == (256, 1024, 4096, 8192) for r in small)
    large = grids.get_grid("large")
    assert [(r.B, r.H) for r in large] == [(8, 32), (16, 32), (4, 64), (8, 64), (16, 64)]
    assert all(r.Ts == (2048, 4096, 8192) for r in large)
    assert all(r.BH >= 256 for r in large)
    assert len(grids.cells(large)) == 15
    assert grids.cells(small)[:2] == [(1, 4, 256), (1, 4, 1024)]
    with pytest.raises(ValueError):
        grids.get_grid("nope")


# --------------------------------------------------------------------------- roofline


def test_kda_roofline_by_hand():
    B, H, T, K, V, C = 16, 64, 4096, 128, 128, 64
    tok = B * T * H
    q = k = v = o = tok * K * 2  # bf16
    g = tok * K * 4  # fp32, per channel
    beta = tok * 2
    state = B * H * K * V * 4
    nbytes = q + k + v + g + beta + o + state
    assert nbytes == 6_517_948_416

    per_chunk = (
        2 * C * C * K  # k k^T
        + 2 * C * C * K  # q k^T
        + 2 * C * C * K  # w = T kg
        + 2 * C * C * V  # u = T v
        + 2 * C * C * V  # tril(Aqk) v_new
        + 3 * 2 * C * K * V  # w S, q S, kg^T v_new
        + C**3  # triangular solve
    )
    flops = B * H * (T // C) * per_chunk
    assert flops == 773_094_113_280

    cost = roofline.cell_cost("kda", B, H, T)
    assert (cost.bytes, cost.flops) == (nbytes, flops)
    fl, bound = roofline.floor_us(cost)
    assert bound == "memory"
    assert fl == pytest.approx(nbytes / 4.2e12 * 1e6)
    assert fl == pytest.approx(1551.9, abs=0.1)

    # compute-bound when the bandwidth ceiling is raised a lot
    fl2, bound2 = roofline.floor_us(cost, roofline.Ceilings.from_cli(bw_tbs=100.0, tflops=729.0))
    assert bound2 == "compute"
    assert fl2 == pytest.approx(flops / 729e12 * 1e6)


def test_bandwidth_ceiling_follows_the_card():
    """The sweep's default bandwidth ceiling is the card's measured copy bandwidth."""
    assert roofline.copy_bw_tbs("NVIDIA H100 80GB HBM3") == 3.0
    assert roofline.copy_bw_tbs("NVIDIA H200") == 4.2
    assert roofline.copy_bw_tbs("NVIDIA B200") == 4.2


def test_gdn_and_decode_roofline():
    B, H, T = 2, 8, 100  # T not a multiple of 64: two chunks
    gdn = roofline.cell_cost("gdn", B, H, T)
    tok = B * T * H
    assert gdn.bytes == tok * 128 * 2 * 4 + tok * 4 + tok * 2 + B * H * 128 * 128 * 4
    assert gdn.flops == B * H * 2 * roofline.chunk_flops()

    B, Hkv, Tkv = 4, 8, 4096
    Hq = 8 * Hkv
    dec = roofline.cell_cost("decode", B, Hkv, Tkv)
    assert dec.flops == 4 * B * Hq * Tkv * 128
    assert dec.bytes == 2 * B * Hq * 128 * 2 + 2 * B * Tkv * Hkv * 128 * 2
    assert roofline.floor_us(dec)[1] == "memory"


# --------------------------------------------------------------------------- report


def _row(B, H, T, ours, peer, err=None, op="kda"):
    """A one-peer row with every key of report.ROW_KEYS, as the sweep writes it."""
    floor = 10.0
    row = dict.fromkeys(report.ROW_KEYS)
    row.update(op=op, B=B, H=H, T=T, ours_us=ours, ours_eager_us=None if ours is None else ours + 5,
               peer="fla 0.6.0 chunk_kda", peer_us=peer, peer_eager_us=peer + 5,
               speedup=None if ours is None else peer / ours, floor_us=floor, floor_bound="memory",
               max_rel_err=err, extra={"input_sets": 4}, peers={"fla": peer}, best_peer="fla",
               speedup_vs_best=None if ours is None else peer / ours, peers_gpu={"fla": peer},
               peers_eager={"fla": peer + 5}, peers_graph={}, peer_errors={} if err is None else {"fla": err},
               peer_failures={})
    return row


def _fake_rows():
    return [
        _row(1, 4, 64, 10.0, 35.7, err=1e-3),  # 3.57
        _row(1, 4, 128, 20.0, 10.0, err=1e-3),  # 0.50 -> we lose
        _row(8, 16, 64, None, 50.0),  # no ours
        _row(8, 32, 64, 10.0, 12.0, err=0.5),  # bad correctness
        _row(16, 32, 64, 10.0, 30.0, err=1e-3),
    ]


def _line(text, prefix):
    return next(l for l in text.splitlines() if l.startswith(prefix))


def test_table_marks_and_separators():
    rows = _fake_rows()
    text = report.format_table(rows, report.speedup, "t", sm_count=132, group_starts={(8, 16)},
                               mark_lose=True, mark_err=True)
    lines = text.splitlines()
    assert lines[1].split("|")[1].split() == ["64", "128"]
    r14 = _line(text, "   1    4     4 |")
    assert " 3.57 " in r14
    assert "0.50!" in r14
    r816 = _line(text, "   8   16   128 |")
    assert "·" in r816 and "!" not in r816
    assert "1.20E" in _line(text, "   8   32   256 |")
    assert "3.00" in _line(text, "  16   32   512 |")
    # separators: plain rule before (8, 16), SM line right before (8, 32) (first B*H >= 132), once
    sm = "─── B*H >= 132 (SM count) ───"
    assert text.count(sm) == 1
    i_sm = lines.index(sm)
    assert lines[i_sm + 1].startswith("   8   32   256 |")
    assert lines[i_sm - 1].startswith("   8   16   128 |")
    assert lines[lines.index(r816) - 1] == "───"
    # the missing (8, 16, 128) cell is shown as ·
    assert r816.split("|")[1].split() == ["·", "·"]


def test_no_sm_separator_when_all_rows_small():
    rows = [_row(1, 4, 64, 10.0, 20.0)]
    text = report.format_table(rows, report.speedup, "t", sm_count=132, mark_lose=True)
    assert "SM count" not in text


def test_report_with_and_without_ours():
    rows = _fake_rows()
    text = report.format_report(rows, op="kda", grid="seed", device="NVIDIA H200", sm_count=132)
    assert "speed-up" in text and "ours_us / floor_us" in text and "peer_us" in text
    # ours/floor for (1,4,64): 10/10 = 1.00
    assert "1.00" in text
    peer_only = [_row(1, 4, 64, None, 35.0), _row(2, 8, 64, None, 120.0)]
    text2 = report.format_report(peer_only, op="kda", grid="small", device="NVIDIA H200", sm_count=132)
    assert "speed-up" not in text2
    assert "35.00" in text2 and "120.0" in text2  # peer times
    assert "3.50" in text2  # peer / floor


def test_result_stem_and_device_name():
    assert report.device_short_name("NVIDIA H200") == "h200"
    assert report.device_short_name("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    stem = report.result_stem("out", "kda", "seed", "NVIDIA H200", "2025-01-02")
    assert stem == Path("out") / "kda_seed_h200_2025-01-02"


def test_json_round_trip(tmp_path):
    rows = _fake_rows()
    rows[0]["max_rel_err"] = math.inf  # non-finite survives as a string and still counts as bad
    meta = {"device": "NVIDIA H200", "date": "2025-01-02", "torch": torch.__version__, "op": "kda",
            "grid": "seed", "ceilings": roofline.Ceilings().as_dict()}
    path = report.write_json(tmp_path / "sub" / "x.json", meta, rows)
    doc = report.read_json(path)
    for k in ("device", "date", "torch", "op", "grid", "ceilings"):
        assert doc[k] == meta[k]
    assert doc["ceilings"] == {"bytes_per_s": 4.2e12, "flops_per_s": 729e12}
    assert len(doc["rows"]) == len(rows)
    assert set(doc["rows"][0]) == set(report.ROW_KEYS)
    assert doc["rows"][2]["ours_us"] is None and doc["rows"][2]["speedup"] is None
    assert doc["rows"][1] == rows[1]
    assert doc["rows"][0]["max_rel_err"] == "inf"
    assert report.rel_err_bad(doc["rows"][0])
    # the tables read the same from the JSON rows as from the originals
    assert report.format_report(doc["rows"], op="kda", grid="seed", device="d", sm_count=132) == \
        report.format_report(rows, op="kda", grid="seed", device="d", sm_count=132)


@pytest.mark.parametrize("with_ours", [True, False])
def test_heatmap_written(tmp_path, with_ours):  # speed-up or peer-time mode
    rows = _fake_rows()
    if not with_ours:
        rows = [dict(r, ours_us=None, speedup=None) for r in rows]
    path = report.write_heatmap(rows, tmp_path / "h.png", title="test")
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- CLI


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cli_without_gpu_exits_2(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.sweep", "--op", "kda", "--grid", "small", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert NO_GPU_MSG in proc.stderr
    assert NO_GPU_MSG == "no CUDA GPU found: the benchmark needs one (nothing was measured)"
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_graph_tables_and_heatmap(tmp_path):
    rows = _fake_rows()
    assert not report.has_graph(rows)
    for r in rows:
        r["extra"]["peer_graph_us"] = r["peer_us"] / 2
        r["extra"]["ours_graph_us"] = None if r["ours_us"] is None else r["ours_us"] / 4
    assert report.has_graph(rows)
    assert report.graph_speedup(rows[0]) == pytest.approx(2 * 3.57)
    text = report.format_report(rows, op="kda", grid="seed", device="d", sm_count=132)
    assert "CUDA-graph replay" in text
    assert "7.14" in text  # graph speed-up of (1, 4, 64)
    path = report.write_heatmap(rows, tmp_path / "g.png", graph=True)
    assert path.stat().st_size > 1000


def test_segments_parsed_from_plan():
    from benchmarks import report
    from schedulers import Problem, SegmentScheduler, SequenceScheduler

    plan = SegmentScheduler().schedule(Problem.fixed(1, 8192, 4), 132, 1).explain()
    assert report.segments({"extra": {"plan": plan}}) == 32.0
    plan = SegmentScheduler().schedule(Problem.varlen([0, 100, 20000], 4), 132, 1).explain()
    assert report.segments({"extra": {"plan": plan}}) == 32.0
    assert report.segments({"extra": {"plan": SequenceScheduler().schedule(Problem.fixed(1, 64, 4)).explain()}}) is None
    assert report.segments({"extra": {}}) is None


def test_path_parsed_from_plan():
    from benchmarks import report
    from cute_kernels.plan import PlanOptions, plan_forward

    two = plan_forward(False, 1, 8192, 4, None, False, 132, "H200", None, PlanOptions("auto")).explain(True)
    assert report.path({"extra": {"plan": two}}) == 2.0
    assert report.segments({"extra": {"plan": two}}) > 1
    fused = plan_forward(False, 32, 1024, 32, None, False, 132, "H200", None, PlanOptions("auto")).explain(True)
    assert report.path({"extra": {"plan": fused}}) == 1.0
    assert report.path({"extra": {"plan": "segment: 4 tiles"}}) is None   # a plan from before the two-phase path
    assert report.path({"extra": {}}) is None
    rows = [{"B": 1, "H": 4, "T": 64, "ours_us": 1.0, "peer_us": 2.0, "extra": {"plan": two}}]
    assert "path chosen by ours" in report.format_report(rows, op="gdn", grid="seed", device="d")


def test_combine_parts(tmp_path):
    from benchmarks import combine, report

    base = {"op": "kda", "grid": "small", "device": "NVIDIA H200", "timer": "do_bench", "graph": False,
            "peer": "fla", "ours": "x", "date": "2026-12-02", "sm_count": 132, "complete": True}
    row = lambda B, H, T, us: {"op": "kda", "B": B, "H": H, "T": T, "ours_us": us, "peer": "fla", "peer_us": 2 * us,
                               "speedup": 2.0, "floor_us": 1.0, "extra": {}}
    p1 = report.write_json(tmp_path / "a.json", base, [row(1, 4, 256, 10.0), row(1, 4, 1024, 20.0)])
    p2 = report.write_json(tmp_path / "b.json", base, [row(2, 8, 256, 30.0)])
    assert combine.main([str(tmp_path / "all.json"), str(p1), str(p2)]) == 0
    d = report.read_json(tmp_path / "all.json")
    assert len(d["rows"]) == 3 and d["parts"] == 2 and d["complete"]
    assert (tmp_path / "all.png").stat().st_size > 0
    text = (tmp_path / "all.txt").read_text()   # the printed tables, kept beside the JSON
    assert text.startswith("speed-up") and "2.00" in text and "ours_us / floor_us" in text
    other = dict(base, op="gdn")
    p3 = report.write_json(tmp_path / "c.json", other, [row(2, 8, 256, 30.0)])
    import pytest

    with pytest.raises(ValueError, match="differ in 'op'"):
        combine.combine([report.read_json(p1), report.read_json(p3)])
    # a label's parenthesized note does not make a different function; the last part's label is kept
    noted = report.write_json(tmp_path / "d.json", dict(base, ours="x (AUTO_SEGMENTS: cost model)"), [row(1, 4, 64, 5.0)])
    meta, rows = combine.combine([report.read_json(noted), report.read_json(p1)])
    assert meta["ours"] == "x" and len(rows) == 3
    # rows in the grid's order whatever the parts' order: "small" lists (1, 4) before (2, 8), T ascending
    _, rows = combine.combine([report.read_json(p2), report.read_json(p1), report.read_json(noted)])
    assert [(r["B"], r["H"], r["T"]) for r in rows] == [(1, 4, 64), (1, 4, 256), (1, 4, 1024), (2, 8, 256)]
    renamed = report.write_json(tmp_path / "e.json", dict(base, ours="y (x)"), [row(1, 4, 64, 5.0)])
    with pytest.raises(ValueError, match="differ in 'ours'"):
        combine.combine([report.read_json(p1), report.read_json(renamed)])


def test_select_cells_lists_and_ranges():
    from benchmarks.sweep import select_cells

    todo = list(range(100, 120))
    assert select_cells(todo, "0:3") == [100, 101, 102]
    assert select_cells(todo, "1,10,18:") == [101, 110, 118, 119]
    assert select_cells(todo, "2,0:3") == [102, 100, 101]   # order given, each cell once
    assert select_cells(todo, "-1") == [119]
    with pytest.raises(SystemExit):
        select_cells(todo, "20")


def test_targets_against_the_floors(tmp_path):
    """benchmarks.targets: target = peer / k on the cells the target covers, set beside the memory floor (bytes at
    the copy bandwidth) and the table floor; numbers checked by hand for one GDN cell."""
    from benchmarks import report, targets
    from benchmarks.roofline import Ceilings

    # GDN B=4 H=8 T=16384: tokens x heads = 524288; bytes = 524288 x (3 x 256 + 2 + 4 + 256) + 32 x 128 x 128 x 4
    tokens = 4 * 16384 * 8
    nbytes = tokens * (3 * 256 + 2 + 4 + 256) + 32 * 128 * 128 * 4
    mem_us = nbytes / 4.2e12 * 1e6
    assert abs(mem_us - 129.1) < 0.1
    comp_us = 32 * 256 * roofline.chunk_flops() / 729e12 * 1e6
    assert comp_us > mem_us   # compute binds the table floor here, just
    extra = {"peer_graph_us": 1053.4, "ours_graph_us": 570.9}
    rows = [
        {"op": "gdn", "B": 4, "H": 8, "T": 16384, "ours_us": 600.0, "peer_us": 1100.0, "peer": "fla", "extra": extra},
        {"op": "gdn", "B": 4, "H": 8, "T": 512, "ours_us": 30.0, "peer_us": 60.0, "peer": "fla", "extra": {}},
        {"op": "gdn", "B": 4, "H": 16, "T": 4096, "ours_us": 250.0, "peer_us": 480.0, "peer": "fla", "extra": {}},
    ]
    eight, three = targets.TARGETS
    t8 = targets.target_rows(rows, eight, Ceilings())
    assert [(t["B"], t["H"], t["T"]) for t in t8] == [(4, 8, 16384)]    # B*H = 64 and T = 512 are not 8x cells
    t = t8[0]
    assert t["target_us"] == 1053.4 / 8                                 # the graph time, not the do_bench one
    assert abs(t["target_over_mem_floor"] - 1053.4 / 8 / mem_us) < 1e-9
    assert abs(t["target_over_floor"] - 1053.4 / 8 / comp_us) < 1e-9 and t["target_over_floor"] < 1.0
    assert abs(t["ours_over_target"] - 570.9 / (1053.4 / 8)) < 1e-9
    t3 = targets.target_rows(rows, three, Ceilings())
    assert [(t["B"], t["H"], t["T"]) for t in t3] == [(4, 8, 16384), (4, 16, 4096)]
    assert t3[1]["target_us"] == 160.0 and t3[1]["ours_over_target"] == 250.0 / 160.0   # do_bench times both sides
    # halving the bandwidth doubles the memory floor
    slow = targets.target_rows(rows, eight, Ceilings(bytes_per_s=2.1e12))[0]
    assert abs(slow["target_over_mem_floor"] * 2 - t["target_over_mem_floor"]) < 1e-9
    # the CLI: summary lines and tables, written to --out
    src = report.write_json(tmp_path / "r.json", {"op": "gdn", "grid": "seed", "device": "NVIDIA H200",
                                                  "ceilings": Ceilings().as_dict(), "sm_count": 132}, rows)
    out = tmp_path / "t.txt"
    assert targets.main([str(src), "--out", str(out)]) == 0
    text = out.read_text()
    assert "8x (B*H <= 32, T >= 4096): 1 cells, met at 0." in text
    assert "within 1.25x of the memory floor" in text and "B=4 H=8 T=16384" in text
    assert "0.99!" in text          # below the table floor is marked
    assert "3x (T >= 1024): 2 cells, met at 0." in text


# --------------------------------------------------------------------------- decode sweep


def test_decode_grid_covers_the_issue():
    from benchmarks import decode

    cells = decode.grid("full")
    plain = {(c.B, c.Hq, c.Hkv, c.kv_len) for c in cells if not c.page_size and not c.ragged}
    assert len(plain) == 7 * 6 * 4
    assert {c.B for c in cells} == {1, 2, 4, 8, 16, 32, 64}
    assert {c.kv_len for c in cells} == {512, 1024, 4096, 16384, 32768, 131072}
    assert {(c.Hq, c.Hkv) for c in cells} == {(32, 8), (32, 4), (64, 8), (32, 32)}
    assert {c.page_size for c in cells} == {0, 16, 64} and any(c.ragged for c in cells)
    assert len(set(cells)) == len(cells)
    with pytest.raises(ValueError, match="unknown decode grid"):
        decode.grid("seed")


def test_decode_flashinfer_pages_from_a_page_table():
    from benchmarks import decode

    table = torch.tensor([[7, 3, 5], [2, 8, 0], [1, 4, 6]], dtype=torch.int32)
    lens = torch.tensor([40, 16, 0], dtype=torch.int32)                  # 3 pages (8 in the last), 1 full, none
    indptr, indices, last = decode.flashinfer_pages(table, lens, 16)
    assert indptr.tolist() == [0, 3, 4, 4]
    assert indices.tolist() == [7, 3, 5, 2]
    assert last.tolist() == [8, 16, 0]


def test_decode_contiguous_cache_as_pages_is_a_view():
    from benchmarks import decode

    k = torch.randn(2, 64, 3, 128)
    k2, _, table = decode.contiguous_as_pages({"k": k, "v": k}, 16)
    assert k2.data_ptr() == k.data_ptr() and k2.shape == (8, 16, 3, 128)
    b, t = 1, 37
    page = table[b, t // 16]
    assert torch.equal(k2[page, t % 16], k[b, t])


def test_decode_report_and_plots(tmp_path):
    from benchmarks import decode

    rows = []
    for L, ours, fa4 in [(4096, 8.0, 20.0), (32768, 40.0, 35.0)]:
        rows.append({"B": 1, "Hq": 32, "Hkv": 8, "kv_len": L, "page_size": 0, "ragged": False, "ours_us": ours,
                     "peers": {"fa4": fa4}, "peer_errors": {"sdpa": "x"}, "best_peer": "fa4",
                     "speedup_vs_best": fa4 / ours, "tbps": L * 8 * 512 / (ours * 1e6), "of_copy_bw": 0.5,
                     "copy_tbps": 3.0})
    table = decode.format_table(rows)
    assert "2.50" in table and " !" in table.splitlines()[-1]   # the lost cell is marked
    paths = decode.write_plots(rows, tmp_path / "decode_test", "test")
    assert all(p.exists() and p.stat().st_size > 1000 for p in paths)


def test_decode_parts_join_in_grid_order(tmp_path):
    import json

    from benchmarks import combine, decode

    cells = decode.grid("full")
    meta = {"op": "decode", "device": "NVIDIA H200", "grid": "full", "timer": "t", "scheduler": "split-kv",
            "date": "2026-12-07", "copy_tbps": 4.0, "peers_missing": {}, "complete": True}

    def row(i, ours):
        c = cells[i]
        return {"B": c.B, "Hq": c.Hq, "Hkv": c.Hkv, "kv_len": c.kv_len, "page_size": c.page_size, "ragged": c.ragged,
                "ours_us": ours, "peers": {"sdpa": 2 * ours}, "peer_errors": {}, "best_peer": "sdpa",
                "speedup_vs_best": 2.0, "tbps": 1.0, "of_copy_bw": 0.25, "copy_tbps": 4.0}

    late = tmp_path / "b.json"
    late.write_text(json.dumps({**meta, "copy_tbps": 4.1, "rows": [row(100, 5.0), row(3, 7.0)]}))
    early = tmp_path / "a.json"
    early.write_text(json.dumps({**meta, "complete": False, "rows": [row(3, 9.0), row(0, 1.0)]}))
    assert combine.main([str(tmp_path / "all.json"), str(early), str(late)]) == 0
    d = json.loads((tmp_path / "all.json").read_text())
    assert [r["ours_us"] for r in d["rows"]] == [1.0, 7.0, 5.0]   # grid order; cell 3 keeps the later part's row
    assert d["parts"] == 2 and not d["complete"] and d["copy_tbps_parts"] == [4.0, 4.1]
    assert (tmp_path / "all_speedup.png").stat().st_size > 1000 and "sdpa" in (tmp_path / "all.txt").read_text()
    with pytest.raises(ValueError, match="device"):
        decode.join_parts([{**meta, "rows": []}, {**meta, "device": "other", "rows": []}])


def test_decode_sweep_without_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sweep", "--op", "decode", "--grid", "quick"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and NO_GPU_MSG in proc.stderr


# --------------------------------------------------------------------------- decode-step sweep


def test_decode_step_grid_and_inputs():
    from benchmarks import recurrent_decode as rd

    cells = rd.grid("full")
    assert {c.B for c in cells} == set(rd.BATCHES) and {c.Sq for c in cells} == {1, 2, 4, 8}
    assert any(c.B * c.H >= 256 for c in cells) and len(set(cells)) == len(cells)
    assert rd.StepCell(2, 8, 1).state_bytes() == 2 * 2 * 8 * 128 * 128 * 4   # read + write, fp32
    x = rd.make_inputs(rd.StepCell(2, 8, 3), True, "cpu")
    assert x["q"].shape == (2, 3, 4, 128) and x["v"].shape == (2, 3, 8, 128)        # GVA 2
    assert x["a"].shape == (2, 3, 8, 128) and x["dt_bias"].shape == (8, 128)        # KDA: per-key gates
    assert x["state"].dtype == torch.float32 and x["idx"].tolist() == [0, 1]
    s = torch.randn(2, 3, 128, 128)
    assert torch.equal(rd.flashinfer_state(s)[1, 2], s[1, 2].T)                    # [K, V] -> FlashInfer's [V, K]
    with pytest.raises(ValueError, match="unknown decode-step grid"):
        rd.grid("seed")


def test_decode_step_report_and_heatmap(tmp_path):
    from benchmarks import recurrent_decode as rd

    rows = [{"B": b, "H": 32, "Sq": sq, "ours_us": 10.0, "peers": {"fla": 20.0 if b == 1 else 8.0},
             "peer_errors": {"flashinfer": "x"}, "best_peer": "fla", "speedup_vs_best": (20.0 if b == 1 else 8.0) / 10,
             "state_tbps": 2.5, "of_copy_bw": 0.8} for b in (1, 64) for sq in (1, 4)]
    table = rd.format_table(rows)
    assert "2.00" in table and table.splitlines()[-1].endswith(" !")   # the lost cell is marked
    path = rd.write_heatmap(rows, tmp_path / "step.png", "test")
    assert path.exists() and path.stat().st_size > 1000


def test_decode_step_sweep_without_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sweep", "--op", "gdn_decode", "--grid", "quick"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and NO_GPU_MSG in proc.stderr


def _peer_row(graph):
    return {"B": 1, "H": 4, "T": 1024, "ours_us": 10.0, "ours_graph_us": 8.0 if graph else None,
            "peers_gpu": {"fla": 30.0, "flashinfer": 12.0, "flashqla": 15.0},
            "peers_eager": {"fla": 60.0, "flashinfer": 20.0, "flashqla": 25.0},
            "peers_graph": {"fla": 25.0, "flashinfer": 11.0, "flashqla": 9.0} if graph else {}, "extra": {}}


@pytest.mark.parametrize("graph", [False, True])
def test_best_peer_and_speedup(graph):
    from benchmarks.report import summarize_peers

    row = summarize_peers(_peer_row(graph), {"flashqla": "flashqla 0.1.3", "flashinfer": "flashinfer 0.7.2.post1"})
    if graph:   # CUDA-graph times decide: flashqla's 9 us against ours' 8
        assert row["peers"] == {"fla": 25.0, "flashinfer": 11.0, "flashqla": 9.0}
        assert row["best_peer"] == "flashqla" and row["speedup_vs_best"] == pytest.approx(9.0 / 8.0)
        assert row["peer"] == "flashqla 0.1.3" and row["extra"]["peer_graph_us"] == 9.0
        assert row["peer_us"] == 15.0 and row["speedup"] == pytest.approx(1.5)
    else:       # GPU times: flashinfer's 12 us against ours' 10
        assert row["best_peer"] == "flashinfer" and row["speedup_vs_best"] == pytest.approx(1.2)
        assert row["peer_eager_us"] == 20.0 and row["extra"]["peer_graph_us"] is None
    empty = summarize_peers({"ours_us": 1.0, "peers_gpu": {}, "extra": {}}, {})
    assert empty["best_peer"] is None and empty["speedup_vs_best"] is None


def test_flashinfer_adapter_conventions():
    from benchmarks.peers import flashinfer_outputs, flashinfer_prepare

    B, T, H, D = 2, 5, 3, 4
    gen = torch.Generator().manual_seed(0)
    x = {"q": torch.randn(B, T, H, D, generator=gen).bfloat16(), "k": torch.randn(B, T, H, D, generator=gen),
         "v": torch.randn(B, T, H, D, generator=gen), "g": -torch.rand(B, T, H, generator=gen),
         "beta": torch.rand(B, T, H, generator=gen).bfloat16()}
    p = flashinfer_prepare(x)
    assert p["q"].shape == (B * T, H, D) and torch.equal(p["q"][T + 2], x["q"][1, 2])
    assert p["g"].dtype == torch.float32 and torch.allclose(p["g"][T + 1], x["g"][1, 1].exp())   # alpha = exp(g)
    assert p["beta"].dtype == torch.float32 and p["beta"].shape == (B * T, H)
    assert p["cu_seqlens"].tolist() == [0, T, 2 * T] and p["cu_seqlens"].dtype == torch.int32
    o = torch.randn(B * T, H, D, generator=gen)
    state_vk = torch.randn(B, H, D, D, generator=gen)   # FlashInfer: [N, H, V, K]
    o4, s = flashinfer_outputs((o, state_vk), p)
    assert torch.equal(o4[1, 3], o[T + 3]) and o4.shape == (B, T, H, D)
    assert torch.equal(s[1, 2, 0, 3], state_vk[1, 2, 3, 0])   # ours: [N, H, K, V]


def test_load_peers_names_and_reasons():
    from benchmarks.peers import load_peers

    with pytest.raises(ValueError, match="unknown peer 'triton'"):
        load_peers("gdn", ["triton"])
    peers, missing = load_peers("kda", ["flashinfer", "flashqla"])
    assert not peers and "SM90" in missing["flashinfer"] and "KDA" in missing["flashqla"]


def test_merge_peers_from_another_process():
    from benchmarks import combine

    meta = {"op": "gdn", "grid": "seed", "device": "d", "timer": "t", "graph": True,
            "peers": {"fla": "fla 0.6.0", "flashinfer": "fi"}, "peers_missing": {"flashqla": "tvm-ffi pin"}}
    main_row = _peer_row(True)
    for field in ("peers_gpu", "peers_eager", "peers_graph"):
        main_row[field].pop("flashqla")
    other_row = {"B": 1, "H": 4, "T": 1024, "ours_us": None, "peers_gpu": {"flashqla": 15.0},
                 "peers_eager": {"flashqla": 25.0}, "peers_graph": {"flashqla": 9.0}, "extra": {}}
    other = {**meta, "peers": {"flashqla": "flashqla 0.1.3"}, "peers_missing": {}, "rows": [other_row]}
    merged_meta, rows = combine.merge_peers({**meta, "rows": [main_row]}, [other])
    assert merged_meta["peers_missing"] == {} and set(merged_meta["peers"]) == {"fla", "flashinfer", "flashqla"}
    assert rows[0]["best_peer"] == "flashqla" and rows[0]["speedup_vs_best"] == pytest.approx(9.0 / 8.0)
    with pytest.raises(ValueError, match="device"):
        combine.merge_peers({**meta, "rows": []}, [{**other, "device": "other"}])


def test_peer_rows_round_trip_through_the_json(tmp_path):
    """A several-peer row keeps every peer's times, errors, the best peer and the speed-up in the JSON, and the
    tables and heatmaps read it like a one-peer row."""
    from benchmarks.report import summarize_peers

    row = summarize_peers(dict(_peer_row(True), op="gdn", floor_us=2.0, floor_bound="memory", max_rel_err=1e-3,
                               peer_errors={"fla": 1e-3, "flashinfer": 2e-3}, peer_failures={"flashqla": "x"}),
                          {"flashqla": "flashqla 0.1.3"})
    path = report.write_json(tmp_path / "gdn_peers.json", {"op": "gdn", "grid": "seed"}, [row])
    back = report.read_json(path)["rows"][0]
    for key in ("ours_graph_us", "peers", "best_peer", "speedup_vs_best", "peers_gpu", "peers_eager", "peers_graph",
                "peer_errors", "peer_failures", "floor_us"):
        assert back[key] == row[key], key
    assert back["best_peer"] == "flashqla" and back["peers"]["fla"] == 25.0
    assert report.has_graph([back])
    assert report.write_heatmap([back], tmp_path / "g.png", graph=True).read_bytes()[:4] == b"\x89PNG"


def test_input_sets_cover_twice_the_l2():
    from benchmarks.sweep import MAX_INPUT_SETS, input_set_count

    l2 = 50e6
    assert input_set_count(int(2 * l2), l2) == 1
    assert input_set_count(int(40e6), l2) == 3                 # 120 MB over three sets
    assert input_set_count(int(4e6), l2) == 25
    assert input_set_count(1 << 20, l2) == MAX_INPUT_SETS     # capped


def test_decode_peers_timed_rotating_through_the_input_sets(monkeypatch):
    """Each timed call of a peer reads the next input set, so a small cache is not timed out of L2."""
    from benchmarks import decode

    class CountingTimer:   # calls the function as a real timer would, a few times per measurement
        def gpu_us(self, fn):
            fn(); fn()
            return 1.0

        def eager_us(self, fn, gpu):
            fn()
            return 2.0, 1

        def graph_us(self, fn, gpu):
            fn(); fn(); fn()
            return 1.0

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    seen = []

    def prepare(x, cell):
        return lambda: seen.append(x["id"]) or torch.zeros(2)

    xs = [{"id": i} for i in range(3)]
    row = {"peers": {}, "peers_eager": {}, "peer_errors": {}, "rel_err": {}, "notes": {}, "ours_us": 2.0}
    decode.time_peers(row, {"p": prepare}, xs, decode.DecodeCell(1, 32, 8, 512), torch.zeros(2), CountingTimer())
    assert row["peer_errors"] == {}
    assert seen[0] == 0                       # the checked output is from the first set
    assert seen[1:] == [0, 1, 2, 0, 1, 2]     # the timed calls cycle through every set
    assert row["peers"]["p"] == 1.0 and row["speedup_vs_best"] == 0.5


def test_decode_step_peers_compared_with_ours_in_their_form():
    """FLA's dense call is compared with our dense call, FlashInfer's pool call (Sq > 1) with our pool call."""
    from benchmarks import recurrent_decode as rd

    def row(sq, peers):
        r = {"ours_us": 10.0, "ours_dense_us": 8.0, "peers": peers}
        rd.compare_in_forms(r, rd.StepCell(4, 8, sq))
        return r

    r = row(1, {"fla": 9.0, "flashinfer": 9.5})
    assert r["peer_forms"] == {"fla": "dense", "flashinfer": "dense"}     # FlashInfer's Sq = 1 kernel has no pool
    assert r["best_peer"] == "fla" and r["speedup_vs_best"] == pytest.approx(9.0 / 8.0)
    r = row(4, {"fla": 12.0, "flashinfer": 9.5})
    assert r["peer_forms"] == {"fla": "dense", "flashinfer": "pool"}
    assert r["best_peer"] == "flashinfer" and r["speedup_vs_best"] == pytest.approx(0.95)
    assert r["speedup_vs_peer"]["fla"] == pytest.approx(1.5)
    r = {"ours_us": 10.0, "ours_dense_us": None, "peers": {"fla": 9.0}}    # our dense call failed: no ratio
    rd.compare_in_forms(r, rd.StepCell(4, 8, 1))
    assert r["speedup_vs_best"] is None and r["best_peer"] == "fla"


def test_decode_step_sweep_passes_every_form_of_ours():
    """The sweep hands `run_cell` a prepare per form (it once passed one function, and every cell read FAIL)."""
    import inspect

    from benchmarks import recurrent_decode as rd

    forms = rd.ours_forms(kda=False)
    assert set(forms) == set(rd.FORMS) and all(callable(p) for p in forms.values())
    assert "ours_forms(kda)" in inspect.getsource(rd.main)
