"""Device half of the schedulers (CuTe DSL): one object every kernel uses, whatever made its tile table.

Inside a `@cute.kernel`:

    sched = TileScheduler.create(tile_table, num_tiles, persistent)   # persistent: a Constexpr bool
    work = sched.initial_work()
    while work.is_valid:
        ...  # work.seq, work.head, work.chunk_start, ...
        work = sched.advance(work)

`tile_table` is a Schedule's int32 table [num_tiles, NUM_TILE_FIELDS] (columns `TILE_FIELDS`), `num_tiles`
its row count. Non-persistent grids give CTA b tile b; persistent grids give CTA b tiles b, b + grid, ...
Host side: `grid_shape(schedule)`.

`EvenSplitScheduler.create(splits, blocks, num_tiles, unit_of=None)` is the same protocol for a split-KV plan whose
table is `splits.even_split_fields` of the row index (`even_split_shape(schedule)`): CTA b computes its tile from b,
so nothing is read before its first load. `unit_of` (a jit function of the tile's unit position) hands the units
out in another order, e.g. longest first.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .problem import TILE_FIELDS
from .splitkv import even_split_fields


def grid_shape(schedule) -> tuple[int, int, int]:
    """The launch grid of a Schedule (host side)."""
    return tuple(schedule.grid)


class _SegmentFlags:
    """`is_first_segment` / `is_last_segment` of a work tile with `segment` and `num_segments`."""

    @property
    def is_first_segment(self):
        return self.segment == 0

    @property
    def is_last_segment(self):
        return self.segment == self.num_segments - 1


class WorkTileDevice(_SegmentFlags):
    """A work tile's fields as Int32 values, read from the tile table, plus a validity flag. Carried through
    `while` loops: it flattens to its index only (fields are re-read from the table)."""

    def __init__(self, table: cute.Tensor, index, num_tiles):
        self._table = table
        self._num_tiles = num_tiles
        self.index = Int32(index)

    @property
    def is_valid(self):
        return self.index < self._num_tiles

    def field(self, name: str):
        return self._table[self.index, TILE_FIELDS.index(name)]

    # One property per column, e.g. work.seq, work.chunk_start.
    seq = property(lambda self: self.field("seq"))
    head = property(lambda self: self.field("head"))
    block = property(lambda self: self.field("block"))
    segment = property(lambda self: self.field("segment"))
    num_segments = property(lambda self: self.field("num_segments"))
    seg_slot = property(lambda self: self.field("seg_slot"))
    chunk_start = property(lambda self: self.field("chunk_start"))
    chunk_end = property(lambda self: self.field("chunk_end"))
    tok_start = property(lambda self: self.field("tok_start"))
    tok_end = property(lambda self: self.field("tok_end"))

    def __extract_mlir_values__(self):
        return [self.index.ir_value()]

    def __new_from_mlir_values__(self, values):
        return WorkTileDevice(self._table, Int32(values[0]), self._num_tiles)


class TileScheduler:
    """Device-side scheduler over a tile table (see the module docstring)."""

    def __init__(self, table: cute.Tensor, num_tiles, persistent: bool):
        self.table = table
        self.num_tiles = num_tiles
        self.persistent = persistent

    @staticmethod
    def create(table: cute.Tensor, num_tiles, persistent: bool = False) -> "TileScheduler":
        return TileScheduler(table, num_tiles, persistent)

    def initial_work(self) -> WorkTileDevice:
        bid, _, _ = cute.arch.block_idx()
        return WorkTileDevice(self.table, bid, self.num_tiles)

    def advance(self, work: WorkTileDevice) -> WorkTileDevice:
        if cutlass.const_expr(self.persistent):
            grid, _, _ = cute.arch.grid_dim()
            return WorkTileDevice(self.table, work.index + grid, self.num_tiles)
        return WorkTileDevice(self.table, self.num_tiles, self.num_tiles)

    def get_current_work(self, work: WorkTileDevice) -> WorkTileDevice:
        return work

    # Loop-invariant: nothing to carry through `while` loops (its values are defined before the loop).
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self


class EvenSplitTile(_SegmentFlags):
    """A work tile of an even split plan, its fields computed from its index (`even_split_fields`): unit `seq`
    (`unit_of` of the unit position, when given), split `segment` of `num_segments`, KV blocks [chunk_start,
    chunk_end), slot `seg_slot` = its index (a unit's splits keep consecutive slots in any unit order)."""

    def __init__(self, index, splits, blocks, num_tiles, unit_of=None):
        self.index = Int32(index)
        self._splits, self._blocks, self._num_tiles, self._unit_of = splits, blocks, num_tiles, unit_of
        self.seq, self.segment, self.chunk_start, self.chunk_end = even_split_fields(self.index, splits, blocks)
        if unit_of is not None:
            self.seq = unit_of(self.seq)
        self.num_segments = splits
        self.seg_slot = self.index
        self.head = Int32(0)
        self.block = Int32(0)

    @property
    def is_valid(self):
        return self.index < self._num_tiles

    def __extract_mlir_values__(self):
        return [self.index.ir_value()]

    def __new_from_mlir_values__(self, values):
        return EvenSplitTile(Int32(values[0]), self._splits, self._blocks, self._num_tiles, self._unit_of)


class EvenSplitScheduler:
    """Device-side scheduler of an even split plan, one tile per CTA, no table (see the module docstring)."""

    def __init__(self, splits, blocks, num_tiles, unit_of=None):
        self.splits, self.blocks, self.num_tiles, self.unit_of = splits, blocks, num_tiles, unit_of

    @staticmethod
    def create(splits, blocks, num_tiles, unit_of=None) -> "EvenSplitScheduler":
        return EvenSplitScheduler(splits, blocks, num_tiles, unit_of)

    def initial_work(self) -> EvenSplitTile:
        bid, _, _ = cute.arch.block_idx()
        return EvenSplitTile(bid, self.splits, self.blocks, self.num_tiles, self.unit_of)

    def advance(self, work: EvenSplitTile) -> EvenSplitTile:
        return EvenSplitTile(self.num_tiles, self.splits, self.blocks, self.num_tiles, self.unit_of)

    def get_current_work(self, work: EvenSplitTile) -> EvenSplitTile:
        return work

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self
