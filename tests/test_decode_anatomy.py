"""scripts/decode_anatomy.py's overlap report from an nsys trace exported as sqlite, and the kernels it takes from
torch's profiler (CPU)."""

import os
import sqlite3
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

import decode_anatomy  # noqa: E402


def test_overlap_gaps_per_range(tmp_path, capsys):
    path = tmp_path / "trace.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE StringIds (id INTEGER, value TEXT)")
    db.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, text TEXT, textId INTEGER)")
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, shortName INTEGER)")
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", [(1, "split"), (2, "reduce"), (3, "decode"),
                                                          (4, "sdpa B=1")])
    db.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?)",
                   [(0, 100_000, "ours B=1", None), (200_000, 300_000, None, 4), (5, None, "marker", None)])
    # ours: two calls 1 us apart; sdpa: the second split starts 0.5 us before the first reduction ends
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?)",
                   [(1_000, 11_000, 3), (12_000, 22_000, 3),
                    (201_000, 209_000, 1), (209_000, 213_000, 2), (212_500, 220_500, 1), (150_000, 151_000, 1)])
    db.commit()
    decode_anatomy.overlap(str(path))
    out = capsys.readouterr().out
    assert "ours B=1: 2 kernels, span 21.0 us, mean gap +1.00 us" in out
    assert "sdpa B=1: 3 kernels, span 19.5 us, mean gap -0.25 us, min gap -0.50 us" in out
    assert "reduce" in out and "x  1     4.00 us" in out


def test_usage_without_a_mode():
    assert decode_anatomy.main([]) == 2


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


class _Event:
    def __init__(self, device, name, start, end):
        self.device_type = type("DeviceType", (), {"name": device})()
        self.name, self.time_range = name, _Range(start, end)


def test_kernel_rows_from_profiler_events():
    events = [_Event("CPU", "cudaGraphLaunch", 0.0, 5.0), _Event("CUDA", "split_kernel", 1.25, 9.5),
              _Event("CUDA", "Memset (Device)", 9.5, 9.6), _Event("CUDA", "lean_reduction", 9.0, 12.0)]
    rows = decode_anatomy.kernel_rows(events)
    assert rows == [(1250, 9500, "split_kernel"), (9000, 12000, "lean_reduction")]
    out = decode_anatomy.overlap_report({"sdpa B=1": rows})
    assert out[0] == "sdpa B=1: 2 kernels, span 10.8 us, mean gap -0.50 us, min gap -0.50 us"
