"""Tile schedulers: which CTA does which (sequence, head, block, segment, chunk range).

Host half (pure Python): `Problem` -> `SequenceScheduler` / `SegmentScheduler` / `PersistentScheduler`
-> `Schedule` (ordered tile table + grid); `plan_segments` picks segment counts and explains why.
Device half (CuTe DSL, imported lazily): `schedulers.device.TileScheduler`, the one protocol every kernel reads
its work through (`initial_work`, `advance`; `grid_shape` on the host); `EvenSplitScheduler` is the same protocol
for an even split-KV plan, each tile computed from the CTA index (`splitkv.even_split_fields`) with no table.
"""

from .heuristics import (SegmentCost, SegmentPlan, plan_segments, plan_segments_by_cost, segmented_cost_us,
                         summary_blocks_of)
from .host import (PersistentScheduler, Schedule, SegmentScheduler, SequenceScheduler, schedule_from_segmentation,
                   summary_schedule)
from .problem import NUM_TILE_FIELDS, TILE_FIELDS, Problem, Segmentation, WorkTile, ceil_div, split_even

__all__ = [
    "NUM_TILE_FIELDS",
    "PersistentScheduler",
    "Problem",
    "Schedule",
    "SegmentCost",
    "SegmentPlan",
    "SegmentScheduler",
    "Segmentation",
    "SequenceScheduler",
    "TILE_FIELDS",
    "WorkTile",
    "ceil_div",
    "plan_segments",
    "plan_segments_by_cost",
    "segmented_cost_us",
    "schedule_from_segmentation",
    "split_even",
    "summary_blocks_of",
    "summary_schedule",
]
