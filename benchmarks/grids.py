"""The (B, H, T) grids swept by ``benchmarks.sweep``.

A grid is a list of :class:`GridRow`; each row is one (B, H) pair with the sequence lengths T to
time for it.  For ``decode`` the same rows are used with H meaning the number of KV heads (Hkv) and
T meaning the KV length (Tkv).

``group`` numbers the blocks of a grid; the report draws a plain separator line where it changes.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_T = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SPARSE_T = (64, 256, 1024, 4096, 16384)


@dataclass(frozen=True)
class GridRow:
    B: int
    H: int
    Ts: tuple[int, ...]
    group: int = 0

    @property
    def BH(self) -> int:
        return self.B * self.H


def _seed() -> list[GridRow]:
    first = [(1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (2, 16), (4, 4), (4, 8), (8, 4)]
    rows = [GridRow(B, H, ALL_T, group=0) for B, H in first]
    # Second block: the first three rows take every T, the rest only SPARSE_T.
    for B, H in [(4, 16), (8, 8), (8, 16)]:
        rows.append(GridRow(B, H, ALL_T, group=1))
    for B, H in [(4, 32), (8, 32), (16, 32), (32, 32), (4, 64), (8, 64), (16, 64)]:
        rows.append(GridRow(B, H, SPARSE_T, group=1))
    # The largest row stops at T = 4096.
    rows.append(GridRow(32, 64, tuple(t for t in SPARSE_T if t <= 4096), group=1))
    return rows


def _small() -> list[GridRow]:
    return [GridRow(B, H, (256, 1024, 4096, 8192)) for B, H in [(1, 4), (2, 8), (4, 16)]]


def _large() -> list[GridRow]:
    return [GridRow(B, H, (2048, 4096, 8192)) for B, H in [(8, 32), (16, 32), (4, 64), (8, 64), (16, 64)]]


GRIDS = {"seed": _seed, "small": _small, "large": _large}


def get_grid(name: str) -> list[GridRow]:
    """The rows of grid ``name`` (one of ``GRIDS``), in table order."""
    try:
        return GRIDS[name]()
    except KeyError:
        raise ValueError(f"unknown grid {name!r}; choose one of {sorted(GRIDS)}") from None


def cells(rows: list[GridRow]) -> list[tuple[int, int, int]]:
    """The (B, H, T) cells of a grid, row by row, T ascending."""
    return [(r.B, r.H, t) for r in rows for t in r.Ts]


def group_starts(rows: list[GridRow]) -> set[tuple[int, int]]:
    """The (B, H) of each row that starts a new group (the first row excluded)."""
    return {(r.B, r.H) for prev, r in zip(rows, rows[1:]) if r.group != prev.group}
