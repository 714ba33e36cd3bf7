"""scripts/profile_lines.py's report: warp-stall samples summed per Python line from ncu's source page (CPU)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

import profile_lines  # noqa: E402

HEADER = ('"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_long_sb","stall_barrier (Not Issued)"')


def section(path, rows):
    return "\n".join([f'"File Path","{path}"', '"Function Name","kernel_x"', HEADER] + rows)


PAGE = "\n".join([
    section("/r/kernels/a.py", [
        '"10","x = load()","-","-","30","20","0","30","0"',
        '"","","0x10","  LDG.E R0, [R2]","30","20","0","30","0"',   # a SASS row: not counted again
        '"11","bar()","-","-","10","10","9","1","900"',
        '"12","idle()","-","-","-","-","-","-","-"',                 # no samples: left out
    ]),
    section("/r/kernels/b.py", ['"5","y = x * 2","-","-","60","5","0","0","0"']),
])


def test_report_sums_per_line_and_file(tmp_path, capsys):
    f = tmp_path / "page.csv"
    f.write_text(PAGE)
    profile_lines.report(str(f), top=10)
    out = capsys.readouterr().out
    assert "100 warp-stall samples on 3 source lines" in out
    assert "60.00%  b.py" in out and "40.00%  a.py" in out
    lines = [ln for ln in out.splitlines() if ":" in ln and "%" in ln and "py:" in ln]
    assert [ln.split()[1] for ln in lines] == ["b.py:5", "a.py:10", "a.py:11"]
    assert "long_sb=100%" in lines[1]
    # the "(Not Issued)" columns are not reasons of their own
    assert "barrier=90% long_sb=10%" in lines[2]
